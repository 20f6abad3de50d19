"""A target's own MTP head through the node's engine beside mlx-vlm's own speculative generation (issue 42).

    python tools/bench/bench_mtp_families.py                  # the Qwen3.5 fixture, k = 1..4, 24 tokens a prompt
    python tools/bench/bench_mtp_families.py --fixture NAME   # another family's fixture (the factory's name)
    python tools/bench/bench_mtp_families.py --model DIR --k 2,3 --tokens 64 --prompts 8
    python tools/bench/bench_mtp_families.py --fixture mimo-mtp-tiny --node-only   # a family mlx-vlm cannot run
    python tools/bench/bench_mtp_families.py --fixture llama-eagle3-tiny   # an EAGLE-3 drafter (eagle3_vlm.py)
    python tools/bench/bench_mtp_families.py --fixture qwen3-dflash-tiny   # a DFlash drafter (dflash_vlm.py)
    python tools/bench/bench_mtp_families.py --fixture qwen3-dspark-tiny   # a DSpark drafter (dflash_vlm.py too)
    python tools/bench/bench_mtp_families.py --fixture qwen3-dflash2-tiny  # a DFlash2 drafter (dflash_vlm.py too)
    python tools/bench/bench_mtp_families.py --fixture gemma4-dflash-tiny  # Gemma 4 DFlash (dflash_vlm.py too)
    python tools/bench/bench_mtp_families.py --fixture gemma4-dspark-tiny  # Gemma 4 DSpark (dflash_vlm.py too)
    python tools/bench/bench_mtp_families.py --fixture muse_glimmer-dflash-tiny  # MuseGlimmer's (dflash_vlm.py too)
    python tools/bench/bench_mtp_families.py --fixture laguna-dflash-tiny  # Laguna DFlash (dflash_vlm.py too)

The same checkpoint (by default the fixture factory's `qwen3_5-mtp-tiny`, its head distilled briefly, built into a
temporary directory), the same prompts, the same k and greedy decoding, two ways:

- node: the provider's engine in-process (speculation `on`, k drafts a round), one job at a time; its telemetry's
  emitted tokens and target forwards (the first token's forward counted, as for every job);
- mlx-vlm: `mlx_vlm.generate.ar.generate_step` with the head loaded by mlx-vlm itself (`load_drafter(kind="mtp")`,
  its in-memory split of the checkpoint's `mtp.*` tensors) and `draft_block_size = k + 1` (the bonus token and k
  drafts a round); its target forwards are 1 + the rounds the drafter recorded.

Tokens per target forward are what each delivered over what each ran, summed over the prompts; the ratio
node / mlx-vlm is the acceptance bar (>= 0.95). Half the prompts are those the head was distilled on (drafts
often accepted), half held out (seldom): both paths see the same mix. Greedy output of both is checked against
mlx-lm's plain decoding. Wall tokens/s is printed too, but this CPU is shared: read it as noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx

from provider import logs
from provider.jobs import Job, SamplingParams
from tools.bench.bench_spec_batch import one_job
from tools.harness.nodes import make_node

NAME = "mtp-bench"
TEXT = "The provider node serves language models to a network of clients. It loads a model when a job needs it. "


def prompts(path: Path, n: int, tokens: int) -> list[list[int]]:
    """n prompts: half the head's training prompts, half held-out text of 6 to 60 tokens; only prompts whose
    plain greedy continuation has no end-of-sequence token within `tokens` (the node stops there, mlx-vlm's
    generate_step does not, so the two would deliver different counts)."""
    from mlx_lm import load

    from tools.fixtures.mtp import train_prompts

    _, tok = load(str(path))
    text = tok.encode(TEXT * 8)
    eos = set(tok.eos_token_ids)
    candidates = train_prompts()
    clean = [p for p, out in zip(candidates, plain(path, candidates, tokens)) if not eos & set(out)][:n // 2]
    held = [text[7 * i:7 * i + 6 + 3 * i] for i in range(3 * n)]
    clean += [p for p, out in zip(held, plain(path, held, tokens)) if not eos & set(out)][:n - len(clean)]
    assert len(clean) == n, f"only {len(clean)} of {len(candidates) + len(held)} prompts run {tokens} tokens clean"
    return clean


def plain(path: Path, ps: list[list[int]], n: int) -> list[list[int]]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))
    return [[t for t, _ in itertools.islice(generate_step(mx.array(p), model, max_tokens=n), n)] for p in ps]


def node_runs(path: Path, ps: list[list[int]], n: int, k: int,
              drafter: Path | None = None) -> tuple[list[list[int]], int, int, float]:
    """(outputs, tokens delivered, target forwards, wall seconds) through the engine (`drafter`: a configured
    EAGLE-3 drafter, else the target's own head)."""
    node = make_node({NAME: path}, max_concurrent_jobs=1, speculation="on", speculation_k=k,
                     manager_kw={"drafters": {NAME: drafter}} if drafter else None)

    async def one(i: int, p: list[int]) -> tuple[list[int], dict]:
        job = Job(f"k{k}-{i}", NAME, SamplingParams(max_tokens=n, temperature=0.0), prompt_ids=tuple(p))
        ids, spec = await one_job(node, job)
        assert spec.get("mode") == "mtp" and spec.get("reason") == "ok", spec
        return ids, spec

    async def main():
        await one(-1, ps[0])  # loads the pair and the head
        t0 = time.perf_counter()
        results = [await one(i, p) for i, p in enumerate(ps)]
        wall = time.perf_counter() - t0
        await node.stop()
        return results, wall

    results, wall = asyncio.run(main())
    outs = [ids for ids, _ in results]
    return outs, sum(map(len, outs)), sum(s["target_forwards"] for _, s in results), wall


def vlm_runs(path: Path, ps: list[list[int]], n: int, k: int,
             drafter: Path | None = None) -> tuple[list[list[int]], int, int, float]:
    """The same through mlx-vlm's own loop and its own loading of the head (an EAGLE-3 drafter: eagle3_vlm; a
    DFlash drafter: dflash_vlm)."""
    if drafter is not None:
        from provider.models.capability import read_config
        from provider.drafters.dflash.config import is_dflash
        from tools.bench import dflash_vlm, eagle3_vlm

        return (dflash_vlm if is_dflash(read_config(drafter)) else eagle3_vlm).runs(path, drafter, ps, n, k)
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load

    model, _ = load(str(path))
    drafter, kind = load_drafter(str(path), kind="mtp")
    outs, forwards = [], 0

    def one(p: list[int]) -> list[int]:
        nonlocal forwards
        before = getattr(drafter, "speculative_total_rounds", 0)
        steps = generate_step(mx.array([p]), model, None, None, max_tokens=n, temperature=0.0,
                              draft_model=drafter, draft_kind=kind, draft_block_size=k + 1)
        out = [int(t) for t, _ in itertools.islice(steps, n)]
        forwards += 1 + getattr(drafter, "speculative_total_rounds", 0) - before
        return out

    one(ps[0])  # warm, as the node's first job
    forwards = 0
    t0 = time.perf_counter()
    outs = [one(p) for p in ps]
    return outs, sum(map(len, outs)), forwards, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a checkpoint with its MTP head (default: --fixture, built now)")
    ap.add_argument("--fixture", default="qwen3_5-mtp-tiny",
                    help="a target with its own head, by name (tools.fixtures.mtp.HEAD_FIXTURES)")
    ap.add_argument("--drafter", type=Path, help="an EAGLE-3 or DFlash drafter for --model (a fixture's is found beside it)")
    ap.add_argument("--k", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--node-only", action="store_true", help="no mlx-vlm baseline (a family it has no drafter for)")
    args = ap.parse_args()
    logs.configure("warning", "console")
    ks = [int(x) for x in args.k.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from tools.fixtures.mtp import build_head_fixture

            path = build_head_fixture(args.fixture, Path(tmp))
        from tools.fixtures import dflash, eagle3

        beside = [d for d in (eagle3.drafter_dir(path), dflash.drafter_dir(path)) if d.is_dir()]
        drafter = args.drafter or (beside[0] if beside else None)
        ps = prompts(path, args.prompts, args.tokens)
        truth = plain(path, ps, args.tokens)
        print(f"{path.name}: {len(ps)} prompts, {args.tokens} tokens each, greedy; tokens per target forward")
        print(f"{'k':>2} {'node':>6} {'mlx-vlm':>8} {'ratio':>6} {'node tok/s':>10} {'vlm tok/s':>9}  greedy = plain")
        worst = None
        for k in ks:
            n_out, n_tok, n_fwd, n_wall = node_runs(path, ps, args.tokens, k, drafter)
            if args.node_only:
                print(f"{k:>2} {n_tok / n_fwd:>6.3f} {'-':>8} {'-':>6} {n_tok / n_wall:>10.1f} {'-':>9}  "
                      f"node {sum(a == b for a, b in zip(n_out, truth))}/{len(ps)}")
                continue
            v_out, v_tok, v_fwd, v_wall = vlm_runs(path, ps, args.tokens, k, drafter)
            node_tpf, vlm_tpf = n_tok / n_fwd, v_tok / v_fwd
            ratio = node_tpf / vlm_tpf
            worst = ratio if worst is None else min(worst, ratio)
            same = f"node {sum(a == b for a, b in zip(n_out, truth))}/{len(ps)}, " \
                   f"mlx-vlm {sum(a == b for a, b in zip(v_out, truth))}/{len(ps)}"
            print(f"{k:>2} {node_tpf:>6.3f} {vlm_tpf:>8.3f} {ratio:>6.3f} {n_tok / n_wall:>10.1f} "
                  f"{v_tok / v_wall:>9.1f}  {same}")
        if args.node_only:
            return 0
        print(f"worst ratio {worst:.3f} (bar 0.95): {'pass' if worst >= 0.95 else 'FAIL'}")
    return 0 if worst is not None and worst >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
