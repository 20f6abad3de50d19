"""`provider bench`: speculation off vs each k vs auto, on the same model and prompts, in one process.

For greedy requests and for sampled ones (temperature 0.7 by default), it times every configuration on
every prompt, side by side, CHUNK tokens each in turn, so a busy machine slows them all alike:
- off: plain decoding with mlx-lm's generate_step, which is what a batch of one computes;
- each k: the node's own round loop;
- auto: the node's own choice of k per job, from the costs it measures at load and the acceptance seen so
  far.

It writes JSON with model paths and hashes, package versions, environment, prompts, generated token ids,
elapsed time, tokens/s, the acceptance rate, tokens per target forward, and whether every greedy
speculative output equals the plain one. For sampled runs it also gives the acceptance rate sample-and-
compare (mlx-lm's scheme) would have had, Σ p·q, beside this scheme's Σ min(p, q). An optional PNG
plots tokens/s and tokens per target forward against k.
"""

from __future__ import annotations

import importlib.metadata as md
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterator

CHUNK = 8  # tokens a configuration decodes per turn

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


def _plain(model, prompt: list[int], n: int, eos: set[int], sampler=None) -> Iterator[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler), n):
        if t in eos:
            return
        yield t


def _speculative(model, drafter_factory, prompt: list[int], n: int, eos: set[int], stats, choice) -> Iterator[int]:
    from ..engine.spec_rounds import speculative_tokens

    tokens = speculative_tokens(model, prompt, drafter_factory(), k=stats.k, stats=stats, choice=choice)
    try:
        for t in itertools.islice(tokens, n):
            if t in eos:
                return
            yield t
    finally:
        tokens.close()


def _advance(stream: Iterator[int], n: int) -> tuple[list[int], float]:
    """Up to n more tokens of a stream and the wall time they took, work queued ahead included: generate_step
    computes its next token asynchronously, and that belongs to the stream that queued it."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    start = time.perf_counter()
    got = list(itertools.islice(stream, n))
    mx.synchronize(generation_stream)
    mx.synchronize()
    return got, time.perf_counter() - start


def _pair(model_path: Path, drafter_path: Path):
    """The loaded target and drafter as the node holds them, and a factory of fresh drafters."""
    from mlx_lm import load

    from ..drafters import registry
    from ..engine.proposers import drafter_for
    from ..memory.checkpoint import read_config
    from ..models.loader import LoadedModel

    model, tok = load(str(model_path))
    lm = LoadedModel("bench", model_path, model, tok, {}, 0.0)
    config = read_config(drafter_path)
    kind = registry.kind_of(model_path, drafter_path, config)  # an assistant, a draft model, any kind the node loads
    lm.drafter = kind.load(model, drafter_path, config, lambda path: load(str(path))[0])
    lm.drafter_mode, lm.drafter_kind = kind.mode, kind.name

    def factory():
        return drafter_for(lm)

    factory.mode = lm.drafter_mode.value
    return lm, factory


def _row(name: str, k: int, elapsed: float, outs: list[list[int]], stats: list) -> dict:
    tokens = sum(map(len, outs))
    row = {"config": name, "k": k, "elapsed_s": round(elapsed, 4), "tokens": tokens,
           "tokens_per_s": round(tokens / elapsed, 3) if elapsed else 0.0, "token_ids": outs}
    spec = [s for s in stats if s is not None]  # None: the prompt ran plain
    drafted, accepted, judged = (sum(getattr(s, f) for s in spec) for f in ("drafted", "accepted", "judged"))
    forwards = sum(s.target_forwards for s in spec) + sum(len(o) for o, s in zip(outs, stats) if s is None)
    row |= {"drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "accepted_per_judged": round(accepted / judged, 4) if judged else 0.0,
            # Emitted tokens over target forwards (plain: one forward a token); EOS/max_tokens cuts included.
            "tokens_per_target_forward": round(tokens / forwards, 4) if forwards else 0.0}
    overlap = [s for s in spec if s.sampling_scheme == "speculative_sampling" and s.judged]
    if overlap:
        judged = sum(s.judged for s in overlap)
        row["expected_acceptance"] = {"speculative_sampling": round(sum(s.min_overlap for s in overlap) / judged, 4),
                                      "sample_and_compare": round(sum(s.dot_overlap for s in overlap) / judged, 4)}
    return row


def _scheme_runs(lm, factory, encoded: list[list[int]], ks: list[int], max_tokens: int, eos: set[int],
                 temperature: float, profile) -> list[dict]:
    """Every configuration (off, each k, auto) on every prompt. The configurations of a prompt decode side by
    side, CHUNK tokens each in turn, each prompt starting one further along: on a shared machine speed drifts
    by tens of percent over seconds, and taking turns this finely puts the drift on all of them alike."""
    from ..engine.acceptance import GreedyChoice, SampledChoice
    from ..engine.sampling import sampler_for
    from ..telemetry import SpecTelemetry
    from ..jobs import SamplingParams
    from ..speculation import GREEDY, SPECULATIVE_SAMPLING

    scheme = GREEDY if temperature == 0 else SPECULATIVE_SAMPLING
    names = ["off", *[f"k={k}" for k in ks], "auto"]
    elapsed = dict.fromkeys(names, 0.0)
    outs: dict[str, list] = {n: [] for n in names}
    stats: dict[str, list] = {n: [] for n in names}
    auto_ks = []
    for i, prompt in enumerate(encoded):
        params = SamplingParams(max_tokens, temperature=temperature, seed=i)
        order = names[i % len(names):] + names[:i % len(names)]
        streams, spec = {}, {}
        for name in order:
            k = int(name[2:]) if name.startswith("k=") else 0
            if name == "auto":
                k = profile.decide(scheme).k
                auto_ks.append(k)
            spec[name] = SpecTelemetry(factory.mode, k=k) if k else None
            if k == 0:
                streams[name] = _plain(lm.model, prompt, max_tokens, eos, None if scheme == GREEDY else sampler_for(params))
            else:
                choice = GreedyChoice() if scheme == GREEDY else SampledChoice(params)
                streams[name] = _speculative(lm.model, factory, prompt, max_tokens, eos, spec[name], choice)
            outs[name].append([])
            stats[name].append(spec[name])
        while streams:
            for name in [n for n in order if n in streams]:
                got, seconds = _advance(streams[name], CHUNK)
                elapsed[name] += seconds
                outs[name][-1] += got
                if len(got) < CHUNK:
                    del streams[name]
        st = spec["auto"]
        if st is not None:
            profile.observe(scheme, st.accepted, st.judged)
    rows = [_row(n, int(n[2:]) if n.startswith("k=") else 0, elapsed[n], outs[n], stats[n]) for n in names]
    rows[-1]["k_chosen"] = auto_ks
    off = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_off"] = round(r["tokens_per_s"] / off, 4) if off else 0.0
        if scheme == GREEDY and r["config"] != "off":
            r["identical_to_plain"] = r["token_ids"] == rows[0]["token_ids"]
    return rows


def run(model_path: Path, drafter_path: Path, ks: list[int], prompts: list[str], max_tokens: int,
        out_path: Path, temperature: float = 0.7) -> dict:
    from ..engine import profile as profiling
    from ..models import manifest

    lm, factory = _pair(model_path, drafter_path)
    eos = set(lm.tokenizer.eos_token_ids)
    encoded = [lm.tokenizer.encode(p) for p in prompts]
    list(_plain(lm.model, encoded[0], 4, eos))  # warm up kernels outside the timings
    started, measured_at = time.perf_counter(), time.time()
    profile = profiling.measure(lm, max(ks))
    seconds = round(time.perf_counter() - started, 3)
    result = {
        "model": {"path": str(model_path), "sha256": manifest.model_hash(manifest.manifest(model_path))},
        "drafter": {"path": str(drafter_path), "mode": factory.mode,
                    "sha256": manifest.model_hash(manifest.manifest(drafter_path))},
        "versions": _versions(), "environment": _environment(), "max_tokens": max_tokens, "prompts": prompts,
        "profile": {"seconds": seconds, "kept": _keep(model_path, drafter_path, factory.mode, profile, measured_at,
                                                      max(ks)), **profile.as_dict()},
        "greedy": _scheme_runs(lm, factory, encoded, ks, max_tokens, eos, 0.0, profile),
        "sampled": {"temperature": temperature,
                    "runs": _scheme_runs(lm, factory, encoded, ks, max_tokens, eos, temperature, profile)},
    }
    out_path.write_text(json.dumps(result, indent=1))
    return result


def _keep(model_path: Path, drafter_path: Path, mode: str, profile, measured_at: float, k_max: int) -> str:
    """The fresh measurement as the node's kept profile of this pair (models.profile_store), so the next load
    reads it: `provider bench` refreshes it. Only a measurement the node would make (its k_max); "" otherwise."""
    from ..engine import profile as profiling
    from ..models import profile_store

    if k_max != profiling.K_MAX:
        return ""
    key = profile_store.pair_key(profile_store.weights_hash(model_path), profile_store.weights_hash(drafter_path),
                                 mode, profiling.SETTINGS)
    try:
        return str(profile_store.write(profile_store.default_dir(), key, profile, measured_at))
    except OSError as e:
        print(f"provider bench: the profile was not kept: {e}", file=sys.stderr)
        return ""


def auto_ratios(runs: list[dict]) -> tuple[float, float, str]:
    """auto's tokens/s over off's and over the best fixed k's, and that k."""
    by = {r["config"]: r["tokens_per_s"] for r in runs}
    best = max((r for r in runs if r["config"].startswith("k=")), key=lambda r: r["tokens_per_s"])
    return by["auto"] / by["off"], by["auto"] / best["tokens_per_s"], best["config"]


def print_summary(result: dict, out_path: Path) -> None:
    print(f"model {result['model']['path']}  drafter {result['drafter']['path']} ({result['drafter']['mode']})")
    p = result["profile"]
    print(f"measured at load ({p['seconds']} s): plain {p['plain_token_ms']} ms/token; a round with k = 1.. "
          f"{', '.join(str(x) for x in p['round_ms'])} ms")
    print(f"kept for the node's next load of this pair: {p['kept']}" if p.get("kept")
          else "not kept (the node measures k = 1..4; run with the default --k to refresh its profile)")
    for title, runs in (("greedy", result["greedy"]), (f"sampled, T = {result['sampled']['temperature']}",
                                                       result["sampled"]["runs"])):
        print(f"\n{title}")
        print(f"{'config':8} {'tokens':>7} {'tok/s':>8} {'vs off':>7} {'accept':>7} {'tok/fwd':>8} {'Σp·q':>6} "
              f"{'identical':>9}")
        for r in runs:
            est = r.get("expected_acceptance", {}).get("sample_and_compare")
            print(f"{r['config']:8} {r['tokens']:>7} {r['tokens_per_s']:>8.1f} {r['speedup_vs_off']:>7.3f} "
                  f"{r['accepted_per_judged']:>7.3f} {r['tokens_per_target_forward']:>8.3f} "
                  f"{'' if est is None else f'{est:.3f}':>6} {str(r.get('identical_to_plain', '-')):>9}")
        vs_off, vs_best, best = auto_ratios(runs)
        chosen = sorted(set(runs[-1]["k_chosen"]))
        print(f"auto chose k in {chosen}: auto/off = {vs_off:.3f}, auto/best fixed ({best}) = {vs_best:.3f}")
    print(f"\nwrote {out_path}")


def plot(result: dict, path: Path) -> bool:
    """tokens/s and tokens per target forward against k, greedy and sampled; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (rate, per_forward) = plt.subplots(1, 2, figsize=(10, 4))
    for label, runs in (("greedy", result["greedy"]), ("sampled", result["sampled"]["runs"])):
        fixed = [r for r in runs if r["config"] == "off" or r["config"].startswith("k=")]
        rate.plot([r["k"] for r in fixed], [r["tokens_per_s"] for r in fixed], marker="o", label=label)
        per_forward.plot([r["k"] for r in fixed], [r["tokens_per_target_forward"] for r in fixed], marker="o",
                         label=label)
        auto = runs[-1]
        rate.axhline(auto["tokens_per_s"], linestyle="--", linewidth=1, label=f"{label} auto")
    rate.set(xlabel="k (0 = off)", ylabel="tokens/s", title="wall-clock tokens/s")
    per_forward.set(xlabel="k (0 = off)", ylabel="tokens per target forward", title="tokens per target forward")
    rate.legend()
    per_forward.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def parse_ks(text: str) -> list[int]:
    """"1,2,3" -> [1, 2, 3]; ValueError with a message for anything else."""
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--k takes draft lengths like 1,2,3, not {text!r}") from None
    if not ks or ks[0] < 1 or ks[-1] > 16:
        raise ValueError(f"--k values must be 1 to 16, got {text!r}")
    return ks


def main(args) -> int:
    try:
        ks = parse_ks(args.k)
        if args.prompts < 1 or args.max_tokens < 1:
            raise ValueError("--prompts and --max-tokens must be at least 1")
        if not 0 < args.temperature <= 2:
            raise ValueError("--temperature (of the sampled runs) must be above 0 and at most 2")
        prompts = DEFAULT_PROMPTS[: args.prompts]
        if args.prompts_file:
            prompts = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
            if not prompts:
                raise ValueError(f"{args.prompts_file} has no prompts")
        if args.drafter is None:
            raise ValueError("the bench compares speculation with plain decoding: give --drafter")
    except (ValueError, OSError) as e:
        print(f"provider bench: {e}", file=sys.stderr)
        return 2
    result = run(args.model, args.drafter, ks, prompts, args.max_tokens, args.out, args.temperature)
    print_summary(result, args.out)
    if args.plot:
        print(f"wrote {args.plot}" if plot(result, args.plot)
              else "no plot: matplotlib is not installed (pip install 'provider-node[plot]')")
    greedy = [r for r in result["greedy"] if "identical_to_plain" in r]
    return 0 if all(r["identical_to_plain"] for r in greedy) else 1
