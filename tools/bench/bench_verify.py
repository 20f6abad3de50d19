"""What checkable work costs: decode throughput with commitments over without, at 1 and at 8 concurrent jobs;
commitment bytes per token; and verification time over generation time, for the same outputs.

Two in-process nodes on the same model, one committing (`commitments = "on"`) and one not, run the same jobs
in alternating rounds (which goes first rotates), speculation off so both take the plain batch. Throughput is
a round's completion tokens over its wall time (the jobs of a round run together); the ratio is of the
medians. Verification reads each committed output back through the model (provider.verification's
ClaimReader, 256-token chunks), timed against that job's own time from arrival to its end, separately for jobs
served alone (c = 1) and 8 at a time (whose own time is longer), and against mlx-lm's one bare forward over the
same tokens on a fresh cache (the floor: a verifier reads every token once).

    python tools/bench/bench_verify.py [--tokens 256] [--rounds 3] [--skip-100m | --skip-bundled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.jobs import Job, SamplingParams  # noqa: E402
from provider.outputs import Done  # noqa: E402
from tools.fixtures import factory  # noqa: E402
from provider.models.default import default_pair  # noqa: E402
from provider.verification.verifier import Claim, ClaimReader  # noqa: E402
from tools.harness.nodes import make_node  # noqa: E402

PROMPTS = [(1, 5, 9, 13, 17, 21), (1, 40, 41, 42, 43), (1, 100, 7, 300, 12, 9, 33, 8), (1, 2, 3, 4)]


async def _job(node, model: str, i: int, tokens: int, tag: str) -> tuple:
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
    job = Job(id=f"{tag}-{i}", model=model, prompt_ids=PROMPTS[i % len(PROMPTS)], sampling=sampling)
    ids, end, t0 = [], None, time.perf_counter()
    async with node.run(job) as stream:
        async for ev in stream:
            ids += getattr(ev, "token_ids", ())
            end = ev
    assert isinstance(end, Done), end
    return job, ids, end, time.perf_counter() - t0


async def _round(node, model: str, concurrency: int, tokens: int, tag: str) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(_job(node, model, i, tokens, tag) for i in range(concurrency)))
    return sum(len(ids) for _, ids, _, _ in outs) / (time.perf_counter() - t0), outs


def verify_seconds(node, model: str, job: Job, ids: list[int], proof) -> tuple[float, bool, float]:
    """(verification seconds, passed, seconds of mlx-lm's one forward over the same tokens)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    lm = node.models.acquire(model)
    try:
        t0 = time.perf_counter()
        reader = ClaimReader(lm, Claim(job.prompt_ids, tuple(ids), job.sampling, proof))
        while not reader.done:
            reader.step(256)
        verdict = reader.verdict()
        took = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(lm.model(mx.array([*job.prompt_ids, *ids])[None], cache=make_prompt_cache(lm.model)))
        return took, verdict.passed, time.perf_counter() - t0
    finally:
        node.models.release(model)


def bench(label: str, path: Path, args) -> dict:
    nodes = {"off": make_node({"m": path}, commitments="off", speculation="off", max_concurrent_jobs=8),
             "on": make_node({"m": path}, commitments="on", speculation="off", max_concurrent_jobs=8)}
    for node in nodes.values():
        asyncio.run(node.preload("m"))
        asyncio.run(_round(node, "m", 2, 8, "warm"))
    rates: dict[int, dict[str, list[float]]] = {c: {"off": [], "on": []} for c in (1, 8)}
    committed: dict[int, list] = {1: [], 8: []}
    for r in range(args.rounds):
        for c in (1, 8):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rate, outs = asyncio.run(_round(nodes[name], "m", c, args.tokens, f"{name}{c}r{r}"))
                rates[c][name].append(rate)
                if name == "on":
                    committed[c] += outs
    per_token = [len(end.proof.commitment) / len(ids) for c in committed for _, ids, end, _ in committed[c] if ids]
    checks = {c: [(*verify_seconds(nodes["on"], "m", job, ids, end.proof), took)
                  for job, ids, end, took in committed[c][:8]] for c in committed}
    for node in nodes.values():
        asyncio.run(node.stop())
    med = statistics.median
    out = {"model": label, "tokens": args.tokens, "rounds": args.rounds,
           "decode_tok_s": {c: {k: round(med(v), 1) for k, v in rates[c].items()} for c in rates},
           "ratio_on_over_off": {c: round(med(rates[c]["on"]) / med(rates[c]["off"]), 3) for c in rates},
           "commitment_bytes_per_token": round(med(per_token), 2),
           "verify_over_generate": {c: round(med(v / took for v, _, _, took in checks[c]), 3) for c in checks},
           "verify_over_one_forward": round(med(v / floor for c in checks for v, _, floor, _ in checks[c]), 3),
           "verified_passed": sum(ok for c in checks for _, ok, _, _ in checks[c]),
           "verified": sum(map(len, checks.values()))}
    print(f"{label}: tok/s off/on c=1 {out['decode_tok_s'][1]['off']}/{out['decode_tok_s'][1]['on']} "
          f"(on÷off {out['ratio_on_over_off'][1]}), c=8 {out['decode_tok_s'][8]['off']}/{out['decode_tok_s'][8]['on']} "
          f"(on÷off {out['ratio_on_over_off'][8]}); {out['commitment_bytes_per_token']} commitment bytes a token; "
          f"verify÷generate {out['verify_over_generate'][1]} (jobs served alone), {out['verify_over_generate'][8]} "
          f"(8 at a time); verify÷mlx-lm's one forward {out['verify_over_one_forward']} "
          f"({out['verified_passed']}/{out['verified']} passed)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--skip-bundled", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores; load average {load[0]:.2f} at start", flush=True)
    results = [] if args.skip_bundled else [bench("bundled", default_pair()[0], args)]
    if not args.skip_100m:
        with tempfile.TemporaryDirectory() as tmp:
            factory.make_llama_100m(Path(tmp) / "llama-100m")
            results.append(bench("llama-100m", Path(tmp) / "llama-100m", args))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
