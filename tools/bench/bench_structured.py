"""What a grammar costs: decode tokens/s of constrained requests (json_schema) over free ones, side by side on
the local node, at 1 and at 8 concurrent requests; and the compile time of schemas and tool grammars.

Both kinds are streamed from the same daemon (the bundled model, speculation off so both take the plain
batch) in alternating rounds. The schema forces a long answer (an array of short strings) and the free
prompt rarely ends early, so both decode max_tokens; the decode rate is the engine's own (telemetry: tokens
after the first over the time since the first), the median over requests. Compile times are of the node's
own path (rules -> Lark -> llguidance matcher and its first mask), in-process, on the same model.

    python tools/bench/bench_structured.py [--tokens 128] [--rounds 3] [--compiles 200]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

LONG = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "minItems": 200, "maxItems": 200}}, "required": ["notes"]}
MESSAGES = [{"role": "user", "content": "Write notes about the provider node and its cache."}]


def one(url: str, constrained: bool, tokens: int) -> dict:
    body = {"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True, "speculation": "off"}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "notes", "schema": LONG}}
    final = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "telemetry" in chunk:
                    final = chunk
    return {"rate": final["telemetry"]["decode_tokens_per_s"], "tokens": final["usage"]["completion_tokens"],
            "mask_ms": final["telemetry"].get("mask_ms_per_token")}


def batch(url: str, constrained: bool, tokens: int, c: int) -> tuple[list[dict], float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        out = list(pool.map(lambda _: one(url, constrained, tokens), range(c)))
    return out, time.perf_counter() - start


def compile_times(path: Path, n: int) -> list[float]:
    """Seconds per compile over a mix of schemas (pydantic-shaped, tool calls, json_object)."""
    from provider.constraints import OutputRules, ResponseFormat, Tool, ToolChoice
    from provider.jobs import Job, SamplingParams
    from provider.prompts import load_prompt_tokenizer

    pt = load_prompt_tokenizer(path.name, path, json.loads((path / "config.json").read_text()))
    person = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                                     "zip": {"anyOf": [{"type": "string"},
                                                                                       {"type": "null"}]}},
                                    "required": ["city"]}},
              "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 120},
                                               "address": {"$ref": "#/$defs/Address"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "address"]}
    tools = tuple(Tool(f"tool_{i}", {"type": "object", "properties": {"q": {"type": "string"},
                                                                       "n": {"type": "integer"}},
                                     "required": ["q"]}) for i in range(8))
    rules = [OutputRules(ResponseFormat("json_schema", person, "person")), OutputRules(ResponseFormat("json_object")),
             OutputRules(ResponseFormat("json_schema", LONG, "notes")),
             OutputRules(tools=tools, tool_choice=ToolChoice("required")),
             OutputRules(tools=tools, tool_choice=ToolChoice("auto"))]
    pt.compiler()  # the llguidance tokenizer, once per model: not a compile
    out = []
    for i in range(n):
        job = Job(f"c{i}", path.name, SamplingParams(max_tokens=8), messages=tuple(MESSAGES), rules=rules[i % len(rules)])
        t0 = time.perf_counter()
        pt.grammar(job)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiles", type=int, default=200)
    args = ap.parse_args()
    path = ensure_default_model()
    server = LocalServer(path, Path(tempfile.mkdtemp(prefix="bench-structured-")), "--no-auth")
    ratios = {}
    try:
        one(server.url, True, 16), one(server.url, False, 16)  # warm both
        for c in (1, 8):
            rates: dict[bool, list[float]] = {True: [], False: []}
            walls: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for constrained in (False, True):
                    results, wall = batch(server.url, constrained, args.tokens, c)
                    rates[constrained] += [x["rate"] for x in results]
                    walls[constrained].append(sum(x["tokens"] for x in results) / wall)
                    mask = [x["mask_ms"] for x in results if x["mask_ms"]]
                    print(f"c={c} round {r + 1} {'constrained' if constrained else 'free       '}: decode "
                          f"{statistics.median(x['rate'] for x in results):7.1f} tok/s per request, "
                          f"{walls[constrained][-1]:7.1f} tok/s together, tokens {[x['tokens'] for x in results]}"
                          + (f", mask {statistics.median(mask):.3f} ms/token" if mask else ""))
            ratios[c] = (statistics.median(rates[True]) / statistics.median(rates[False]),
                         statistics.median(walls[True]) / statistics.median(walls[False]))
    finally:
        server.stop()
    times = sorted(compile_times(path, args.compiles))
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
    print(f"model: {path}")
    for c, (per_request, together) in ratios.items():
        print(f"c={c}: constrained / free decode tok/s = {per_request:.3f} per request, {together:.3f} together "
              "(goal >= 0.9)")
    print(f"schema and tool-grammar compile (with its first mask), {len(times)} compiles: "
          f"p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
