"""What a quantized KV cache trades (issue 40), full precision and kv_bits 8 and 4 side by side in one run, on the
bundled demo model (Gemma 4: 3 sliding-window layers, window 128, and 1 full-attention layer holding KV; fp16; its
windows are stored at 8 bits whatever kv_bits, memory.estimate.sliding_layer_quant) and on the fixture factory's
KV-heavy Llama (4 full-attention layers, 32-wide heads, fp32):

- KV bytes a token over full precision, from what the caches hold (`nbytes`): four rows read to 768 and then to
  1,792 positions (whole 256-position steps, so no spare capacity), per token of growth (the full-attention
  layers; a sliding layer stops at its window) and per row at 1,792 (everything a row holds);
- the concurrency admitted under one fixed memory budget: an in-process node (the real scheduler and
  Residency.admit_batch) given a fixed budget and 96 jobs of a 16-token prompt and max_tokens to 2,000 tokens; the
  jobs it starts before the rest wait for memory (every job is then cancelled);
- decode throughput at 8 concurrent jobs (128 new tokens each after a ~150-token prompt, end tokens biased away),
  alternating precisions over rounds, over full precision's (medians);
- quality: 32 prompts cut from the standard library's docstrings, 32 greedy tokens each, tokens equal to full
  precision's, and the prompts' echo logprobs (every position scored) against full precision's;
- on the demo model, the same quality figures at kv_bits 4 with the sliding windows at 4 bits too (the real
  quantized caches, against the same full-precision run): what storing the windows at 8 bits saves in quality.

    python tools/bench/bench_kv_quant.py [--rounds 3] [--skip-demo] [--skip-llama]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from provider.engine import kv_quant  # noqa: E402
from provider.engine.kv_quant import make_caches  # noqa: E402
from provider.jobs import Job, SamplingParams  # noqa: E402
from provider.outputs import Done  # noqa: E402
from provider.memory.estimate import KVQuant, quant_group, sliding_head_dim  # noqa: E402
from tools.fixtures import factory  # noqa: E402
from provider.models.default import DEMO_TARGET  # noqa: E402
from tools.harness.nodes import make_node  # noqa: E402

BITS = (0, 8, 4)
# The node's whole budget in the admission measurement (the model, its reserves, the rows' KV), per model.
DEMO_BUDGET_MIB, LLAMA_BUDGET_MIB = 184, 480
JOBS = 96
ROWS_AT, FINAL = 16, 2000


def prompts(n: int) -> list[str]:
    """As tests/test_kv_quant.py: `n` prompts of 6 to 20 words from the standard library's docstrings."""
    import functools as ft, json as js, pathlib, shutil, textwrap

    words = " ".join(getattr(f, "__doc__", "") or "" for m in (js, textwrap, ft, pathlib, shutil)
                     for f in vars(m).values() if callable(f)).split()
    return [" ".join(words[(997 * i) % (len(words) - 20):][: 6 + (i * 5) % 15]) for i in range(n)]


def kv_bytes(path: Path) -> dict[int, tuple[float, int]]:
    """Per precision: (bytes a token of growth, bytes a row at 1,792 positions), four rows in one batch."""
    model, _ = load(str(path))
    config = json.loads((path / "config.json").read_text())
    out = {}
    for bits in BITS:
        quant = KVQuant(bits, 64) if bits else None
        rows = [make_caches(model, config, quant) for _ in range(4)]
        batch = [layer[0].merge(list(layer)) for layer in zip(*rows)]
        held = []
        for n in (767, 1023):  # a chunk, then one decode step (a sliding layer's buffer is back to its window)
            model(mx.array([[5] * n] * 4), cache=batch)
            model(mx.array([[5]] * 4), cache=batch)
            mx.eval([c.state for c in batch])
            held.append(sum(c.nbytes for c in batch))
        out[bits] = ((held[1] - held[0]) / (4 * 1024), held[1] // 4)
    return out


def serve(path: Path, bits: int, jobs: list[Job], timed: list | None = None, **settings) -> list:
    """The jobs' (token ids, terminal event) on a fresh node at `bits`; with `timed`, the seconds they took (after
    the model is loaded and has served one token) are appended to it."""
    node = make_node({"m": path}, manager_kw={"kv_bits": bits}, **({"max_concurrent_jobs": 16, "speculation": "off"}
                                                                   | settings))

    async def main():
        async def one(job):
            ids, end = [], None
            async with node.run(job) as stream:
                async for ev in stream:
                    ids += getattr(ev, "token_ids", ())
                    end = ev
            return ids, end

        if timed is not None:
            await one(Job("warm", "m", SamplingParams(1, temperature=0.0), prompt="warm"))
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(j) for j in jobs))
        if timed is not None:
            timed.append(time.perf_counter() - t0)
        await node.stop()
        return out

    return asyncio.run(main())


def admitted(path: Path, bits: int, eos: list[int], budget_mib: int) -> int:
    """Jobs the node starts under `budget_mib` before the rest wait for memory."""
    node = make_node({"m": path}, budget_bytes=budget_mib << 20, manager_kw={"kv_bits": bits},
                     max_concurrent_jobs=JOBS, speculation="off", prefix_cache_gb=0)
    bias = tuple((t, -100.0) for t in eos)

    async def main():
        jobs = [Job(f"a{i}", "m", SamplingParams(FINAL - ROWS_AT, temperature=0.0, logit_bias=bias),
                    prompt_ids=(1,) + (7 + i,) * (ROWS_AT - 1)) for i in range(JOBS)]

        async def one(job):
            async with node.run(job) as stream:
                async for _ in stream:
                    pass

        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        best, settled = 0, 0
        for _ in range(200):
            await asyncio.sleep(0.05)
            st = node.status()
            best = max(best, st.active_jobs)
            settled = settled + 1 if st.active_jobs + st.queue.waiting_for_memory >= JOBS else 0
            if settled >= 10:
                break
        for j in jobs:
            node.cancel(j.id)
        await asyncio.gather(*tasks, return_exceptions=True)
        await node.stop()
        return best

    return asyncio.run(main())


def throughput(path: Path, rounds: int, eos: list[int]) -> dict[int, float]:
    """Completion tokens a second at 8 concurrent jobs, per precision (median over rounds, order rotating)."""
    text = " ".join(prompts(40))[:400]
    bias = tuple((t, -100.0) for t in eos)
    jobs = [Job(f"t{i}", "m", SamplingParams(128, temperature=0.0, logit_bias=bias), prompt=f"{i} {text}")
            for i in range(8)]
    rates: dict[int, list[float]] = {b: [] for b in BITS}
    for r in range(rounds):
        for bits in BITS[r % 3:] + BITS[: r % 3]:
            seconds: list[float] = []
            out = serve(path, bits, jobs, seconds, max_concurrent_jobs=8)
            rates[bits].append(sum(len(ids) for ids, _ in out) / seconds[0])
    return {b: statistics.median(v) for b, v in rates.items()}


def quality(path: Path, bits_list=(8, 4), base: list | None = None) -> tuple[dict[int, tuple[float, float, float]],
                                                                             list]:
    """Per precision: (greedy tokens equal to full precision's, echo logprob |diff| max, mean); and the
    full-precision run they are measured against (`base`, when given, is that run)."""
    ps = prompts(32)
    jobs = [Job(f"g{i}", "m", SamplingParams(32, temperature=0.0), prompt=p) for i, p in enumerate(ps)]
    jobs += [Job(f"e{i}", "m", SamplingParams(0, temperature=0.0, logprobs=1, prompt_logprobs=True), prompt=p)
             for i, p in enumerate(ps)]
    base = base if base is not None else serve(path, 0, jobs)
    out = {}
    for bits in bits_list:
        run = serve(path, bits, jobs)
        same = sum(a == b for (x, _), (y, _) in zip(base[:32], run[:32]) for a, b in zip(x, y))
        total = sum(len(x) for x, _ in base[:32])
        diffs = [abs(a.logprob - b.logprob) for (_, x), (_, y) in zip(base[32:], run[32:])
                 for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
        assert all(isinstance(end, Done) for _, end in run)
        out[bits] = (same / total, max(diffs), statistics.mean(diffs))
    return out, base


def windows_at_4_bits(path: Path, base: list) -> tuple[float, float, float]:
    """`quality` at kv_bits 4 with the sliding windows stored at 4 bits too (sliding_layer_quant set aside)."""
    rule = kv_quant.sliding_layer_quant
    kv_quant.sliding_layer_quant = lambda config, quant: None if quant is None else KVQuant(
        quant.bits, quant_group(sliding_head_dim(config), quant.group_size))
    try:
        return quality(path, (4,), base)[0][4]
    finally:
        kv_quant.sliding_layer_quant = rule


def report(name: str, path: Path, args, eos: list[int], budget_mib: int, windows: bool) -> None:
    print(f"\n== {name}")
    sizes = kv_bytes(path)
    full_tok, full_row = sizes[0]
    for bits in BITS[1:]:
        tok, row = sizes[bits]
        print(f"kv_bits {bits}: KV bytes a token of growth {tok:.0f} vs {full_tok:.0f} = {tok / full_tok:.3f}; "
              f"a row at 1,792 positions {row} vs {full_row} = {row / full_row:.3f}")
    rows = {bits: admitted(path, bits, eos, budget_mib) for bits in BITS}
    print(f"admitted under a {budget_mib} MiB budget, jobs of {FINAL} tokens: " + ", ".join(
        f"kv_bits {b}: {rows[b]} ({rows[b] / max(rows[0], 1):.2f}x)" for b in BITS))
    rates = throughput(path, args.rounds, eos)
    print("decode at c=8 (tok/s): " + ", ".join(f"kv_bits {b}: {rates[b]:.1f} ({rates[b] / rates[0]:.2f}x)"
                                                  for b in BITS))
    figures, base = quality(path)
    for bits, (same, worst, mean) in figures.items():
        print(f"kv_bits {bits}: greedy tokens equal to full precision {same:.3f} (32 prompts x 32); echo logprob "
              f"|diff| max {worst:.4f} mean {mean:.4f} nats")
    if windows:
        same, worst, mean = windows_at_4_bits(path, base)
        print(f"kv_bits 4 with the sliding windows at 4 bits too: greedy tokens equal {same:.3f}; echo logprob "
              f"|diff| max {worst:.4f} mean {mean:.4f} nats")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    demo = json.loads((DEMO_TARGET / "config.json").read_text())
    if not args.skip_demo:
        report("demo model (gemma4-demo)", DEMO_TARGET, args, list(demo["eos_token_id"]), DEMO_BUDGET_MIB,
               windows=True)
    if not args.skip_llama:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "llama-kv-heavy"
            factory.make_llama_kv_heavy(path)
            eos = json.loads((path / "config.json").read_text())["eos_token_id"]
            report("KV-heavy Llama fixture (llama-kv-heavy)", path, args, list(eos), LLAMA_BUDGET_MIB, windows=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
