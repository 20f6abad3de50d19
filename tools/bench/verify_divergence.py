"""Metal's divergence, emulated before a Mac measures it (issue 55): a producer whose numerics differ from the
verifier's the way other kernels' do, with the same weights, against the verifier's tolerances.

On this CPU a width-1 decode and a prefill of a float32 checkpoint agree to float16 rounding, so
`verifier.Tolerance` has only met kernels that agree. Here the producer is the real checkpoint loaded by the
node's loader (`provider.models.loader.load`, the hidden-state tap, the warm-up) and then run with other
numerics, on its own model instance only (the verifier's is untouched):

- on the float32 checkpoint (the verifier reading it in float32):
  `cpu` (unchanged: the control, today's honest spread); `ksplit` (every Linear, and the tied LM head's
  `Embedding.as_linear`, computes x @ W^T as partial matmuls over 16-wide slices of the input dimension summed
  last slice first: another accumulation order); `bf16` / `f16` (weights cast by `set_dtype`, so every
  activation is bfloat16 / float16: a producer that serves the checkpoint in another compute dtype than the
  verifier reads it in);
- on a bfloat16 copy of it (the dtype most checkpoints ship in; the verifier reading it in bfloat16, as mlx-lm
  serves it): `cpu` (this CPU's own decode against its own prefill); `bf16ckpt_ksplit` (the 16-wide partials in
  float32, rounded to bfloat16 once: a gemv against a gemm, both accumulating in float32); `bf16ckpt_tp2` (o_proj
  and down_proj as two halves of the input dimension, each a bfloat16 matmul, summed in bfloat16: a node group of
  two split by projections, whose all_sum adds the ranks' bfloat16 partials); `bf16ckpt_ksplit_bf16acc` (every
  Linear's 16-wide partials rounded to bfloat16 and summed in bfloat16: a split-K kernel that reduces in the
  output dtype, the pessimistic bound);
- on a float16 copy (the bundled demo model's dtype): `cpu`, the control only.

Cheats (tools.fixtures.cheats: 8- and 4-bit, 1% noise, a layer dropped; built from the float32 and the
bfloat16 checkpoint) decode on the verifier's own numerics, the closest a cheater can come to the verifier. Every
outcome is decoded by the producer's own loop (mlx-lm's prompt cache; logits - logsumexp as mlx-lm's generator
computes it; greedy, or the node's positional Gumbel sampler with the job's seed, so seeded tokens are the node's
draws), committed from the producer's final-norm hidden states (hidden_tap.top_entries, CommitmentBuilder, the
end token's row too), and read by the real ClaimReader on the verifier's model, every position; then judged by
the verifier's own match_chunk and judge under any tolerance. The same prompts and samplings for every variant
and cheat: a third greedy, a third seeded at T 0.3-1.2, a third seeded with top-p, top-k or min-p.

Prints, per model, checkpoint and variant: the honest spread (least chunk overlap, largest chunk mean and point
relative error, the least share of the verifier's top-4 indices the producer committed to, the 99.9th percentile
point error, the largest token gap of greedy and of unfiltered seeded jobs, filtered seeded jobs whose token check
fails, tokens not the verifier's choice per 100, pass rate under today's Tolerance) and each cheat's (of the job
closest to passing: the largest least-overlap and the least largest-mean-error over its jobs; jobs the token checks
alone catch; pass rate); then per variant a tolerance chosen from the honest spread with margin (`propose`)
and what honest jobs and each cheat do under it; then per-backend profiles, each the cover of its variants'
proposals over every model and checkpoint (`PROFILES`: `cpu` today's, `divergent_kernels`, `worst_kernels`,
`other_compute_dtype`), and what every variant and cheat does under each. A measurement, not a test: it exits 0
whatever it finds. About 5 minutes on 2 cores at the defaults (3.5 at --jobs 6); the docs' figures are of --jobs 30.

    python tools/bench/verify_divergence.py [--jobs 9] [--tokens 64] [--seed 55] [--models gemma4-tiny,llama-tiny]
        [--json OUT.json] [--save OUTCOMES.pkl | --load OUTCOMES.pkl]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import math
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from provider.engine.output import end_ids  # noqa: E402
from provider.engine.sampling import sampler_for  # noqa: E402
from provider.jobs import SamplingParams  # noqa: E402
from provider.outputs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER, Proof  # noqa: E402
from tools.fixtures import cheats as cheat_fixtures, factory  # noqa: E402
from provider.models.loader import LoadedModel, load, warm_up  # noqa: E402
from provider.proofs.commitment import CHUNK, ChunkMatch, CommitmentBuilder, decode, match_chunk  # noqa: E402
from provider.proofs.hidden_tap import install, top_entries  # noqa: E402
from provider.verification.verifier import Claim, ClaimReader, Tolerance, Verdict, judge  # noqa: E402

TODAY = Tolerance()


def tolerance(**kw) -> Tolerance:
    """Today's Tolerance with these values (`profile` only where this tree's Tolerance names one)."""
    names = {f.name for f in dataclasses.fields(Tolerance)}
    return dataclasses.replace(TODAY, **{k: v for k, v in kw.items() if k in names})


SLICE = 16  # the input-dimension slice of a K-split matmul
CHEATS = ("quantized_8bit", "quantized_4bit", "noise_1pct", "layer_dropped")
# rel_tol candidates for a proposed tolerance (today's first).
REL_TOLS = (0.02, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3)


# --- numerics of the producer --------------------------------------------------------------------------------

def _split(x: mx.array, w: mx.array, width: int, acc) -> mx.array:
    """x [..., K] @ w[N, K]^T as partial matmuls over `width`-wide slices of K, summed last slice first in `acc`."""
    k = w.shape[-1]
    out = None
    for s in reversed(range(0, k, width)):
        part = x[..., s:s + width].astype(acc) @ w[:, s:s + width].T.astype(acc)
        out = part if out is None else out + part
    return out.astype(x.dtype)


def use_split(model: nn.Module, acc, *, halves: bool = False, only: tuple[str, ...] = ()) -> int:
    """Every nn.Linear's __call__ and nn.Embedding's as_linear of this model instance (a class swap per instance,
    as hidden_tap swaps the final norm's; `only`: those whose attribute name is one of these) compute as `_split`
    over SLICE-wide slices (`halves`: two halves); returns how many were swapped."""
    n = 0
    for name, m in model.named_modules():
        base = type(m)
        if only and name.rsplit(".", 1)[-1] not in only:
            continue
        width = (lambda w: max(1, w.shape[-1] // 2)) if halves else (lambda w: SLICE)
        if base is nn.Linear:
            def call(self, x, width=width):
                y = _split(x, self.weight, width(self.weight), acc)
                return y + self.bias if "bias" in self else y
            m.__class__ = type(f"Split{base.__name__}", (base,), {"__call__": call})
            n += 1
        elif base is nn.Embedding:
            m.__class__ = type(f"Split{base.__name__}", (base,),
                               {"as_linear": lambda self, x, width=width: _split(x, self.weight, width(self.weight),
                                                                                 acc)})
            n += 1
    return n


def variants_of(ckpt: str) -> dict:
    """name -> what it does to the producer's LoadedModel (after load, before the tap and the warm-up)."""
    if ckpt == "f16":
        return {"cpu": lambda lm: None}
    if ckpt == "f32":
        return {"cpu": lambda lm: None,
                "bf16": lambda lm: lm.model.set_dtype(mx.bfloat16),
                "f16": lambda lm: lm.model.set_dtype(mx.float16),
                "ksplit": lambda lm: use_split(lm.model, mx.float32)}
    return {"cpu": lambda lm: None,
            "bf16ckpt_ksplit": lambda lm: use_split(lm.model, mx.float32),
            # A node group of two split by projections (mlx-lm's sharded-to-all o_proj and down_proj): each rank's
            # half of the input dimension a bfloat16 matmul, the two summed in bfloat16 (all_sum).
            "bf16ckpt_tp2": lambda lm: use_split(lm.model, mx.bfloat16, halves=True, only=("o_proj", "down_proj")),
            "bf16ckpt_ksplit_bf16acc": lambda lm: use_split(lm.model, mx.bfloat16)}


def loaded(name: str, path: Path, change=None) -> LoadedModel:
    """As the node loads a model (loader.load, the tap, the warm-up), with `change` applied to its instance."""
    lm = load(name, path)
    if change is not None:
        change(lm)
    lm.hidden_tap = install(lm.model)
    warm_up(lm)
    return lm


def cast_checkpoint(src: Path, out: Path, dtype) -> Path:
    """The checkpoint's floating weights saved in `dtype` (bfloat16: as most real checkpoints ship), same config."""
    cheat_fixtures._copy_tokenizer(src, out)
    w = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
         for k, v in cheat_fixtures._weights(src).items()}
    cheat_fixtures._save(out, json.loads((src / "config.json").read_text()), w)
    return out


# --- outcomes --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    prompt: tuple[int, ...]
    sampling: SamplingParams


def jobs_for(tokenizer, n: int, tokens: int, rng: random.Random) -> list[Job]:
    """Chat prompts of corpus words; a third greedy, a third seeded at T 0.3-1.2, a third seeded with a filter."""
    words = factory.CORPUS.split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        if i % 3 == 0:
            s = SamplingParams(max_tokens=tokens, temperature=0.0)
        else:
            kw = rng.choice([{"top_p": 0.95}, {"top_k": 40}, {"min_p": 0.05}]) if i % 3 == 2 else {}
            s = SamplingParams(max_tokens=tokens, temperature=round(rng.uniform(0.3, 1.2), 2),
                               seed=rng.randrange(1 << 31), **kw)
        out.append(Job(prompt, s))
    return out


def produce(lm: LoadedModel, job: Job) -> tuple[tuple[int, ...], Proof, np.ndarray, np.ndarray]:
    """The producer's own decode: prefill, then one token a step on mlx-lm's cache, each token drawn from
    logits - logsumexp (mlx-lm's generator) by the node's sampler, each row's top entries from this model's
    final-norm hidden state. Returns the output, its proof, and the committed entries [rows, K]."""
    s = job.sampling
    cache = make_prompt_cache(lm.model)
    ends = end_ids(lm.tokenizer, s)
    sample = sampler_for(s, lm.decodable)
    builder = CommitmentBuilder(lm.hidden_tap.hidden_size)
    rows_idx, rows_bits = [], []
    y = mx.array(job.prompt)[None]
    out: list[int] = []
    end = None
    for _ in range(s.max_tokens):
        logits = lm.model(y, cache=cache)[:, -1, :]
        idx, bits = top_entries(lm.hidden_tap.last[:, -1, :])
        token = sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(token, idx, bits)
        builder.add(np.array(idx), np.array(bits))
        rows_idx.append(np.array(idx)[0])
        rows_bits.append(np.array(bits)[0])
        t = int(token.item())
        if t in ends:
            end = t
            break
        out.append(t)
        y = mx.array([[t]])
    rows = len(out) + (end is not None)
    proof = Proof(builder.finish(rows), GREEDY_SAMPLER if s.greedy else REPLAYABLE_SAMPLER,
                  None if s.greedy else s.seed, end_token=end)
    return tuple(out), proof, np.stack(rows_idx), np.stack(rows_bits)


@dataclasses.dataclass
class Outcome:
    """One claim as the verifier read it, whole: its own entries and token gaps, and the commitment's polynomials,
    so it can be judged again under any tolerance by the verifier's own functions (match_chunk, judge)."""

    kind: str  # variant or cheat
    params: SamplingParams
    sampler: str
    tokens: int
    polys: list  # (modulus, coefficients) per chunk
    indices: np.ndarray  # the verifier's top entries [tokens, K]
    bits: np.ndarray
    gaps: np.ndarray  # per position (replay.token_gaps)
    hidden_size: int
    early: str  # a failure before anything was read (claim rules), else ""
    agree: np.ndarray  # per chunk: the share of the verifier's top-4 indices the producer committed to
    rel: np.ndarray  # the relative errors of those points (the value the verifier would read back)
    _chunks: dict = dataclasses.field(default_factory=dict)

    @property
    def job_kind(self) -> str:
        p = self.params
        return "greedy" if p.greedy else "seeded" if (p.top_p >= 1.0 and p.top_k == 0 and p.min_p == 0) else "filtered"

    def chunks(self, rel_tol: float) -> list[ChunkMatch]:
        if rel_tol not in self._chunks:
            self._chunks[rel_tol] = [
                match_chunk(i * CHUNK, m, c, self.indices[i * CHUNK:(i + 1) * CHUNK],
                            self.bits[i * CHUNK:(i + 1) * CHUNK], self.hidden_size, rel_tol)
                for i, (m, c) in enumerate(self.polys)]
        return self._chunks[rel_tol]

    def verdict(self, tol: Tolerance = TODAY) -> Verdict:
        if self.early:
            return Verdict(False, self.early, 0, self.tokens)
        return judge(self.tokens, self.chunks(tol.rel_tol), self.gaps, self.sampler, tol)


# Read every position whatever it finds (a reader that takes a tolerance stops at the first failing chunk).
READ_ALL = tolerance(min_overlap=0.0, max_mean_err=math.inf, tie=math.inf, max_tie_share=1.0, floor=math.inf)


def verify(ref: LoadedModel, job: Job, out, proof: Proof, p_idx: np.ndarray, p_bits: np.ndarray,
           kind: str) -> Outcome:
    """The claim read by the real ClaimReader on the verifier's model."""
    claim = Claim(job.prompt, out, job.sampling, proof)
    takes_tolerance = "tolerance" in inspect.signature(ClaimReader).parameters
    reader = ClaimReader(ref, claim, tolerance=READ_ALL) if takes_tolerance else ClaimReader(ref, claim)
    while not reader.done:
        reader.step(512)
    early = getattr(reader, "failure", None)
    v = reader.verdict()
    n = len(reader.tokens)
    gaps = np.array(v.gaps, dtype=float)
    if early is not None or len(gaps) < n:
        return Outcome(kind, job.sampling, proof.sampler, n, [], np.zeros((0, 4)), np.zeros((0, 4)), gaps, 0,
                       getattr(early, "reason", v.reason) or "not read whole", np.zeros(0), np.zeros(0))
    v_idx, v_bits = reader.entries()
    polys = decode(proof.commitment, n)
    agree, rel = [], []
    own = v_bits.astype(np.uint16).view(np.float16).astype(np.float64)
    theirs = p_bits.astype(np.uint16).view(np.float16).astype(np.float64)
    for c in range(0, n, CHUNK):
        hit = 0
        for t in range(c, min(c + CHUNK, n)):
            where = {int(i): k for k, i in enumerate(p_idx[t])}
            for k, i in enumerate(v_idx[t]):
                if int(i) in where:
                    hit += 1
                    rel.append(abs(theirs[t, where[int(i)]] - own[t, k]) / max(abs(own[t, k]), 1e-3))
        agree.append(hit / v_idx[c:c + CHUNK].size)
    return Outcome(kind, job.sampling, proof.sampler, n, polys, v_idx, v_bits, gaps, ref.hidden_tap.hidden_size, "",
                   np.array(agree), np.array(rel))


# --- statistics --------------------------------------------------------------------------------------------------

def stats(outcomes: list[Outcome], tol: Tolerance = TODAY) -> dict:
    """The spread of these outcomes judged under `tol`. Per outcome its worst chunk decides, so for cheats the
    figures are of the outcome closest to passing: the largest of the outcomes' least chunk overlap, the least of
    their largest chunk mean error."""
    vs = [o.verdict(tol) for o in outcomes]
    chunks = [c for v in vs for c in v.chunks]
    worst_ov = [min((c.overlap for c in v.chunks), default=0.0) for v in vs]
    worst_mean = [max((c.mean_rel_err for c in v.chunks), default=math.inf) for v in vs]
    rel = np.concatenate([o.rel for o in outcomes]) if outcomes else np.zeros(0)
    tokens_only = tolerance(**{**_fields(tol), "min_overlap": 0.0, "max_mean_err": math.inf})

    def gaps(kinds) -> list[float]:
        return [g for o in outcomes if o.job_kind in kinds for g in o.gaps]

    numeric = [g for g in gaps(("greedy", "seeded")) if math.isfinite(g)] or [0.0]
    tokens = sum(v.tokens for v in vs)
    by_kind = {k: (sum(v.passed for o, v in zip(outcomes, vs) if o.job_kind == k),
                   sum(1 for o in outcomes if o.job_kind == k)) for k in ("greedy", "seeded", "filtered")}
    return {"n": len(vs), "passed": sum(v.passed for v in vs), "by_kind": by_kind, "tokens": tokens,
            "min_overlap": min(worst_ov, default=1.0), "max_mean_err": max(worst_mean, default=0.0),
            "closest_overlap": max(worst_ov, default=0.0), "closest_mean_err": min(worst_mean, default=math.inf),
            "max_rel_err": max((c.max_rel_err for c in chunks), default=0.0),
            "min_agree": float(min((a for o in outcomes for a in o.agree), default=1.0)),
            "closest_agree": float(max((min(o.agree, default=0.0) for o in outcomes), default=0.0)),
            "p999_rel": float(np.quantile(rel, 0.999)) if rel.size else 0.0,
            "max_gap_greedy": max([g for g in gaps(("greedy",)) if math.isfinite(g)], default=0.0),
            "max_gap_seeded": max([g for g in gaps(("seeded",)) if math.isfinite(g)], default=0.0),
            "max_gap_numeric": max(numeric),
            "max_share_numeric": max((sum(1 for g in o.gaps if g > 0) / max(1, o.tokens)
                                      for o in outcomes if o.job_kind != "filtered"), default=0.0),
            "filtered_token_fails": sum(not o.verdict(tokens_only).passed for o in outcomes
                                        if o.job_kind == "filtered"),
            "median_gap": float(np.median([g for o in outcomes for g in o.gaps] or [0.0])),
            "not_argmax_per_100": 100 * sum(1 for o in outcomes for g in o.gaps if g > 0) / max(1, tokens),
            "caught_by_tokens": sum(not o.verdict(tokens_only).passed for o in outcomes),
            "reasons": sorted({" ".join(v.reason.split(" ")[:4]) for v in vs if v.reason})}


def _fields(t: Tolerance) -> dict:
    return {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}


def _up(x: float, step: float) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 6)


def _down(x: float, step: float) -> float:
    return round(math.floor(x / step + 1e-9) * step, 6)


def propose(honest: list[Outcome], name: str) -> Tolerance:
    """A tolerance that holds this honest spread with margin. rel_tol: the smallest candidate at least twice the
    honest points' 99.9th-percentile relative error; min_overlap: the honest chunks' least overlap at it less 0.1
    (in 0.05 steps; never above today's 0.9); max_mean_err: twice the honest chunks' largest mean error at it;
    tie: twice the largest gap of a greedy or unfiltered seeded token; max_tie_share: twice the largest share of
    such an output's tokens that were not the verifier's choice. Each at least today's. Filtered seeded jobs
    (top-p, top-k, min-p) are left out of tie and share: a token at the filter's edge is in one side's support
    and not the other's, an infinite or a gap of nats, which no tie holds without giving up the token check."""
    p999 = float(np.quantile(np.concatenate([o.rel for o in honest]), 0.999)) if honest else 0.0
    rel_tol = next((r for r in REL_TOLS if r >= 2 * p999), REL_TOLS[-1])
    st = stats(honest, tolerance(rel_tol=rel_tol, min_overlap=0, max_mean_err=1, tie=math.inf, max_tie_share=1))
    return tolerance(profile=name, rel_tol=max(TODAY.rel_tol, rel_tol),
                     min_overlap=min(TODAY.min_overlap, max(0.05, _down(st["min_overlap"] - 0.1, 0.05))),
                     max_mean_err=max(TODAY.max_mean_err, _up(2 * st["max_mean_err"], 0.001)),
                     tie=max(TODAY.tie, _up(2 * st["max_gap_numeric"], 0.01)),
                     max_tie_share=max(TODAY.max_tie_share, _up(2 * st["max_share_numeric"], 0.01)))


def cover(tols: list[Tolerance], name: str) -> Tolerance:
    """The loosest of each value: a profile that holds every one of these spreads."""
    return tolerance(profile=name, rel_tol=max(t.rel_tol for t in tols),
                     min_overlap=min(t.min_overlap for t in tols), max_mean_err=max(t.max_mean_err for t in tols),
                     tie=max(t.tie for t in tols), max_tie_share=max(t.max_tie_share for t in tols))


def fmt_tol(t: Tolerance) -> str:
    return (f"rel_tol={t.rel_tol:g} min_overlap={t.min_overlap:g} max_mean_err={t.max_mean_err:g} "
            f"tie={t.tie:g} max_tie_share={t.max_tie_share:g}")


def fmt_pass(s: dict) -> str:
    k = s["by_kind"]
    return (f"{s['passed']}/{s['n']} (greedy {k['greedy'][0]}/{k['greedy'][1]}, seeded {k['seeded'][0]}/"
            f"{k['seeded'][1]}, filtered {k['filtered'][0]}/{k['filtered'][1]})")


# --- the run -----------------------------------------------------------------------------------------------------

CHECKPOINTS = {"f32": None, "bf16": mx.bfloat16, "f16": mx.float16}
CHEATS_OF = ("f32", "bf16")  # the checkpoints whose cheats are built and judged


def run_model(model: str, root: Path, args, rng: random.Random, log) -> dict:
    src = root / "fx" / model
    result = {}
    for ckpt, dtype in CHECKPOINTS.items():
        path = src if dtype is None else cast_checkpoint(src, root / f"{model}-{ckpt}", dtype)
        t0 = time.perf_counter()
        ref = loaded(model, path)
        jobs = jobs_for(ref.tokenizer, args.jobs, args.tokens, random.Random(rng.randrange(1 << 31)))
        honest: dict[str, list[Outcome]] = {}
        for name, change in variants_of(ckpt).items():
            lm = loaded(model, path, change)
            honest[name] = [verify(ref, j, *produce(lm, j), name) for j in jobs]
            del lm
            log(f"  {model}/{ckpt} {name}: {time.perf_counter() - t0:.0f}s")
        bad = {"quantized_8bit": lambda o: cheat_fixtures.quantized(path, o, 8),
               "quantized_4bit": lambda o: cheat_fixtures.quantized(path, o, 4),
               "noise_1pct": lambda o: cheat_fixtures.noisy(path, o, 0.01),
               "layer_dropped": lambda o: cheat_fixtures.layer_dropped(path, o, 1)}
        cheats: dict[str, list[Outcome]] = {}
        for name in CHEATS if ckpt in CHEATS_OF else ():
            with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its quantization
                made = bad[name](root / f"{model}-{ckpt}-{name}")
            lm = loaded(model, made)
            cheats[name] = [verify(ref, j, *produce(lm, j), name) for j in jobs]
            del lm
            log(f"  {model}/{ckpt} cheat {name}: {time.perf_counter() - t0:.0f}s")
        result[ckpt] = {"honest": honest, "cheats": cheats}
    return result


def table(model: str, ckpt: str, res: dict, out) -> dict:
    honest, cheats = res["honest"], res["cheats"]
    reads = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[ckpt]
    out(f"\n### {model}, {ckpt} checkpoint (the verifier reads it in {reads})\n")
    out("| honest variant | jobs | tokens | min overlap | max mean_rel_err | max rel err | min top-4 agree "
        "| p99.9 point err | max gap greedy | max gap seeded | filtered: token fails | not-argmax /100 tok "
        "| pass (today) |")
    out("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, os_ in honest.items():
        s = stats(os_)
        out(f"| {name} | {s['n']} | {s['tokens']} | {s['min_overlap']:.3f} | {s['max_mean_err']:.4f} "
            f"| {s['max_rel_err']:.4f} | {s['min_agree']:.3f} | {s['p999_rel']:.4f} | {s['max_gap_greedy']:.3f} "
            f"| {s['max_gap_seeded']:.3f} | {s['filtered_token_fails']}/{s['by_kind']['filtered'][1]} "
            f"| {s['not_argmax_per_100']:.2f} | {fmt_pass(s)} |")
    proposals = {name: propose(os_, name) for name, os_ in honest.items()}
    if not cheats:
        out("\n| variant | proposed tolerance | honest pass |")
        out("|---|---|---|")
        for name, os_ in honest.items():
            out(f"| {name} | {fmt_tol(proposals[name])} | {fmt_pass(stats(os_, proposals[name]))} |")
        return proposals
    out("\n| cheat | jobs | largest min overlap of a job | least max mean_rel_err of a job "
        "| largest min top-4 agree of a job | median token gap | caught by tokens alone (today) | pass (today) |")
    out("|---|---|---|---|---|---|---|---|")
    for name, os_ in cheats.items():
        s = stats(os_)
        out(f"| {name} | {s['n']} | {s['closest_overlap']:.3f} | {s['closest_mean_err']:.4f} "
            f"| {s['closest_agree']:.3f} | {s['median_gap']:.3f} | {s['caught_by_tokens']}/{s['n']} "
            f"| {s['passed']}/{s['n']} |")
    out("\n| variant | proposed tolerance | honest pass | " + " | ".join(f"{c} pass (tokens catch)" for c in cheats)
        + " |")
    out("|---|---|---|" + "---|" * len(cheats))
    for name, os_ in honest.items():
        t = proposals[name]
        cells = [f"{s['passed']}/{s['n']} ({s['caught_by_tokens']})" for s in (stats(cs, t) for cs in cheats.values())]
        out(f"| {name} | {fmt_tol(t)} | {fmt_pass(stats(os_, t))} | " + " | ".join(cells) + " |")
    # How the honest variants' worst and each cheat's closest job move with rel_tol (today's other values).
    out("\n| rel_tol | " + " | ".join(f"{n}: min ov / max mean" for n in honest) + " | "
        + " | ".join(f"{c}: largest min ov / least max mean" for c in cheats) + " |")
    out("|---|" + "---|" * (len(honest) + len(cheats)))
    for r in REL_TOLS:
        loose = tolerance(rel_tol=r)
        hs = [stats(os_, loose) for os_ in honest.values()]
        cs = [stats(os_, loose) for os_ in cheats.values()]
        out(f"| {r:g} | " + " | ".join(f"{s['min_overlap']:.3f} / {s['max_mean_err']:.4f}" for s in hs) + " | "
            + " | ".join(f"{s['closest_overlap']:.3f} / {s['closest_mean_err']:.4f}" for s in cs) + " |")
    return proposals


# Per backend kind, the (checkpoint, variant) pairs whose honest spread its profile must hold.
# `divergent_kernels`: the producer and the verifier run the checkpoint in its own dtype on kernels that differ:
# another accumulation order, a gemv against a gemm (this CPU's own decode against its prefill on a bfloat16
# checkpoint is one), and a node group's bfloat16 all_sum for the families mlx-lm splits by projections.
# `worst_kernels`: and the all_sum for every family, and the split-K reduced in bfloat16 (the pessimistic bound).
# `other_compute_dtype`: a producer that computes in another dtype than the checkpoint's, read as shipped.
KERNELS = {("f32", "ksplit"), ("bf16", "cpu"), ("bf16", "bf16ckpt_ksplit"), ("f16", "cpu")}
PROFILES = {
    "divergent_kernels": lambda splits: KERNELS | ({("bf16", "bf16ckpt_tp2")} if splits else set()),
    "worst_kernels": lambda splits: KERNELS | {("bf16", "bf16ckpt_tp2"), ("bf16", "bf16ckpt_ksplit_bf16acc")},
    "other_compute_dtype": lambda splits: {("f32", "bf16"), ("f32", "f16")},
}


def splits_by_projections(model: str) -> bool:
    """Whether mlx-lm splits this fixture's family by projections (its model class has `shard`)."""
    from mlx_lm.utils import _get_classes

    with tempfile.TemporaryDirectory() as tmp:
        factory.FIXTURES[model](Path(tmp))
        config = json.loads((Path(tmp) / model / "config.json").read_text())
    return hasattr(_get_classes(config)[0], "shard")


def profiles(everything: dict, out) -> dict:
    """Each profile the cover of its pairs' proposals over every model, and what every honest variant and cheat does
    under it (today's `cpu` first)."""
    chosen = {"cpu": TODAY}
    splits = {m: splits_by_projections(m) for m in everything}
    for name, pairs_of in PROFILES.items():
        tols = [propose(r["honest"][v], v) for m, rs in everything.items() for c, r in rs.items()
                for v in r["honest"] if (c, v) in pairs_of(splits[m])]
        chosen[name] = cover(tols, name)
    out(f"\n(split by projections by mlx-lm: {', '.join(m for m, s in splits.items() if s) or 'none'})")
    for label, t in chosen.items():
        out(f"\n#### profile {label}: {fmt_tol(t)}\n")
        out("| model / checkpoint | honest pass, per variant | " + " | ".join(CHEATS) + " |")
        out("|---|---|" + "---|" * len(CHEATS))
        for m, rs in everything.items():
            for c, r in rs.items():
                honest = ", ".join(f"{v} {stats(os_, t)['passed']}/{len(os_)}" for v, os_ in r["honest"].items())
                cells = []
                for k in CHEATS:
                    s = stats(r["cheats"][k], t) if k in r["cheats"] else None
                    cells.append("-" if s is None else f"{s['passed']}/{s['n']} (tokens catch {s['caught_by_tokens']})")
                out(f"| {m} / {c} | {honest} | " + " | ".join(cells) + " |")
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=9, help="jobs per variant and per cheat (a third each: greedy, "
                                                        "seeded, seeded with a filter)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every job")
    ap.add_argument("--seed", type=int, default=55)
    ap.add_argument("--models", default="gemma4-tiny,llama-tiny", help="fixture models (tools.fixtures.factory)")
    ap.add_argument("--json", default="", help="also write the proposals and statistics here")
    ap.add_argument("--save", default="", help="pickle the outcomes here (to judge them again with --load)")
    ap.add_argument("--load", default="", help="judge the outcomes a --save pickled instead of making new ones")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    out = lambda m: print(m, flush=True)  # noqa: E731
    if args.load:
        with open(args.load, "rb") as f:
            saved = pickle.load(f)
        everything, made = saved["outcomes"], saved["header"]
    else:
        made = (f"verify_divergence {datetime.datetime.now().isoformat(timespec='minutes')}: jobs {args.jobs}, "
                f"tokens {args.tokens}, seed {args.seed}")
        everything = {}
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for model in args.models.split(","):
                factory.FIXTURES[model](root / "fx")
                everything[model] = run_model(model, root, args, rng, log)
        if args.save:
            with open(args.save, "wb") as f:
                pickle.dump({"header": made, "outcomes": everything}, f)
    out(f"{made}; today's Tolerance: {fmt_tol(TODAY)}")
    dump = {}
    for model, results in everything.items():
        for ckpt, res in results.items():
            proposals = table(model, ckpt, res, out)
            dump[f"{model}/{ckpt}"] = {"proposals": {n: _fields(t) for n, t in proposals.items()},
                                       "honest": {n: stats(o) for n, o in res["honest"].items()},
                                       "cheats": {n: stats(o) for n, o in res["cheats"].items()}}
    out("\n### Profiles: each the cover of its variants' proposals, over every model and checkpoint")
    dump["profiles"] = {k: _fields(t) for k, t in profiles(everything, out).items()}
    out(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
