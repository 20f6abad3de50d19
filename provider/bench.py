"""`provider bench`: speculation off vs on (k in a small range) on the same model and prompts, in one process.

It times one job alone: plain decoding with mlx-lm's generate_step (what a batch of one computes), and
speculation with the node's own round loop; and writes JSON: model paths and hashes, package versions, environment, prompts, generated
token ids, elapsed time, tokens/s, acceptance and tokens per target forward, and whether every speculative
output equals the plain one.
"""

from __future__ import annotations

import importlib.metadata as md
import itertools
import json
import os
import platform
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "The provider node serves language models",
    "def generate(prompt, max_tokens=16):",
    "A cache keeps recent keys and values",
    "Speculative decoding drafts tokens with a small model",
    "Numbers: 1 2 3 4 5",
    "Returns the value of the attribute, or the default",
    "class Cache:\n    def trim(self, n):",
    "Install the package with pip and import it",
    "This module provides functions for working with paths",
    "The quick brown fox jumps over the lazy dog",
]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "provider-node", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _environment() -> dict:
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    metal = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "mlx_backend": "metal" if metal else "cpu", "device": info.get("device_name", ""),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "PROVIDER_", "OMP_"))}}


def _plain(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n):
        if t in eos:
            break
        out.append(t)
    return out


def _speculative(model, drafter_factory, prompt: list[int], n: int, eos: set[int], k: int):
    from .engine.speculative import SpecStats, speculative_tokens

    stats = SpecStats(drafter_factory.mode, k)
    out = []
    for t in itertools.islice(speculative_tokens(model, prompt, drafter_factory(), k=k, stats=stats), n):
        if t in eos:
            break
        out.append(t)
    return out, stats


def run(model_path: Path, drafter_path: Path | None, ks: list[int], prompts: list[str], max_tokens: int,
        out_path: Path) -> dict:
    from mlx_lm import load

    from .engine.speculative import DraftModelDrafter, MTPDrafter, Target
    from .models import capability, manifest
    from .models.gemma4_assistant import load_assistant

    model, tok = load(str(model_path))
    eos = set(tok.eos_token_ids)
    encoded = [tok.encode(p) for p in prompts]
    result = {
        "model": {"path": str(model_path), "sha256": manifest.model_hash(manifest.manifest(model_path))},
        "drafter": None, "versions": _versions(), "environment": _environment(), "max_tokens": max_tokens,
        "prompts": prompts, "runs": [],
    }
    factory = None
    if drafter_path is not None:
        dcfg = capability.read_config(drafter_path)
        if dcfg.get("model_type") in capability.ASSISTANT_TYPES:
            assistant, target = load_assistant(drafter_path), Target(model)

            def factory():
                return MTPDrafter(assistant, target)

            factory.mode = "mtp"
        else:
            draft, _ = load(str(drafter_path))

            def factory():
                return DraftModelDrafter(draft)

            factory.mode = "draft"
        result["drafter"] = {"path": str(drafter_path), "mode": factory.mode,
                             "sha256": manifest.model_hash(manifest.manifest(drafter_path))}

    _plain(model, encoded[0], 4, eos)  # warm up kernels outside the timings
    start = time.perf_counter()
    plain = [_plain(model, p, max_tokens, eos) for p in encoded]
    elapsed = time.perf_counter() - start
    tokens = sum(map(len, plain))
    result["runs"].append({"speculation": "off", "k": 0, "elapsed_s": round(elapsed, 4), "tokens": tokens,
                           "tokens_per_s": round(tokens / elapsed, 3), "token_ids": plain,
                           "target_forwards": tokens, "tokens_per_target_forward": 1.0})
    for k in ks if factory else []:
        start = time.perf_counter()
        outs, stats = zip(*[_speculative(model, factory, p, max_tokens, eos, k) for p in encoded])
        elapsed = time.perf_counter() - start
        tokens = sum(map(len, outs))
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        forwards = sum(s.target_forwards for s in stats)
        result["runs"].append({
            "speculation": factory.mode, "k": k, "elapsed_s": round(elapsed, 4), "tokens": tokens,
            "tokens_per_s": round(tokens / elapsed, 3), "token_ids": list(outs),
            "identical_to_plain": list(outs) == plain, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0, "target_forwards": forwards,
            # Emitted tokens over target forwards, the prefill forward counted; EOS/max_tokens cuts included.
            "tokens_per_target_forward": round(sum(s.emitted for s in stats) / forwards, 4),
            "speedup_vs_off": round((tokens / elapsed) / result["runs"][0]["tokens_per_s"], 4),
        })
    out_path.write_text(json.dumps(result, indent=1))
    return result


def print_summary(result: dict, out_path: Path) -> None:
    print(f"model {result['model']['path']}  drafter {result['drafter']['path'] if result['drafter'] else '-'}")
    print(f"{'speculation':12} {'k':>2} {'tokens':>7} {'tok/s':>9} {'accept':>7} {'tok/fwd':>8} {'identical':>9}")
    for r in result["runs"]:
        print(f"{r['speculation']:12} {r['k']:>2} {r['tokens']:>7} {r['tokens_per_s']:>9.1f} "
              f"{r.get('acceptance_rate', 0):>7.3f} {r['tokens_per_target_forward']:>8.3f} "
              f"{str(r.get('identical_to_plain', '-')):>9}")
    print(f"wrote {out_path}")


def main(args) -> int:
    prompts = DEFAULT_PROMPTS[: args.prompts]
    if args.prompts_file:
        prompts = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    ks = [int(x) for x in args.k.split(",")]
    result = run(args.model, args.drafter, ks, prompts, args.max_tokens, args.out)
    print_summary(result, args.out)
    spec = [r for r in result["runs"] if r["k"]]
    return 0 if all(r["identical_to_plain"] for r in spec) else 1

