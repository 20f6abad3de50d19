"""Honest work always passes, cheating is caught where it starts: a campaign of verified jobs (issue 39).

Honest: jobs across the engine's paths, made on producer nodes that commit (the fixture gemma4-tiny alone and
in batches of 16 with mixed lengths and sampling, prefix hits, prefill chunks 64 and 2048; the bundled MTP pair
and the llama draft pair speculating; logprob jobs; a quarter of them structured output, under a JSON schema's
grammar, which the verifier replays; a node group of two split by projections and one split by layers; image jobs
on the tiny Gemma 4 VLM, one or two images of random sizes, plain and MTP, a third behind a shared system prompt,
checked by verify jobs carrying the images), each verified on a separate verifier node holding the real weights.
Expected: 0 false rejections.

Cheats, each claimed as the real model's work and verified the same way: other weights (1% noise, on gemma4-tiny
and on llama-tiny, where most values move by less than rel_tol), the real
weights quantized by mlx-lm to 8 and 4 bits, one layer dropped, another system prompt, the drafter's output
alone (llama-tiny-draft for llama-tiny), a higher temperature than declared, another seed than declared, and a
splice (the real model's first k tokens, then another model's, with a commitment the forger computed with the
real weights over the whole output: the strongest forgery, answered by the token checks). Expected: each caught
in >= 99.9% of its jobs, and where it starts (the first token that is not the real model's, or the first chunk
whose hidden states are another model's; never before, and past it only by near-ties).

Cheats against the request (issue 55: what is checked follows from the request, never from the proof), each with
a commitment the forger computed with the real weights (`forged`), so only the request's checks can stop them:
- cheap_speculative: a seeded job (T 0.8, top_p 0.95 and 1.0 alternately) answered by the 4-bit copy decoding it,
  declared `speculative` (no seed);
- other_seed_replayable: a seeded job answered with the real model's output for another seed, declared
  `replayable` with that seed;
- greedy_for_sampled, greedy_for_unseeded: a T 0.8 job, seeded or not, answered greedily, declared `greedy`;
- speculative_on_greedy, replayable_on_greedy: a greedy job answered with random ids (below the vocabulary, no
  end id, max_tokens of them), declared `speculative`, or `replayable` with some seed;
- overlong: a job of max_tokens 4 answered with the real model's honest output of 32 (its own label);
- made_up_eos: the real model's honest output (greedy or seeded) cut at k < its length, an EOS claimed after it;
- cut_short: the same cut with no end token claimed (the request has no stop string).
A declaration that contradicts the request starts the cheat at position 0; overlong at max_tokens; a cut at k.
A claim the verifier raises on instead of judging is counted apart ("the verifier raised"), never as caught.

The honest jobs' near-ties (Verdict.ties: tokens within the tie tolerance of the expected one) are printed: in
all, per 100 tokens, and the most in one job.

    python tools/scripts/verify_campaign.py [--honest 2000] [--cheats 1000] [--group 200] [--images 200]
        [--kinds K,...] [--tokens 48] [--seed 39]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.constraints import OutputRules, ResponseFormat  # noqa: E402
from provider.engine.kv_quant import caches_for  # noqa: E402
from provider.engine.output import end_ids  # noqa: E402
from provider.jobs import Job, SamplingParams  # noqa: E402
from provider.outputs import REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER, Done, Proof  # noqa: E402
from tools.fixtures import cheats as cheat_fixtures, factory as fixtures  # noqa: E402
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET  # noqa: E402
from provider.proofs.commitment import CommitmentBuilder  # noqa: E402
from provider.proofs.hidden_tap import install, top_entries  # noqa: E402
from provider.verification.verifier import Claim, ClaimReader  # noqa: E402
from tools.harness.group import start_group  # noqa: E402
from tools.harness.nodes import make_node  # noqa: E402

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
WEIGHT_CHEATS = {"noise_1pct": "g", "quantized_8bit": "g", "quantized_4bit": "g", "layer_dropped": "g",
                 "noise_1pct_llama": "llama"}  # served instead of the model claimed
# Cheats against the request itself (issue 55): the forger holds the real weights and commits to its output with them
# (`forged`), so only the checks the request calls for (sampler, seed, length, ending) can stop it.
REQUEST_CHEATS = ("cheap_speculative", "other_seed_replayable", "greedy_for_sampled", "greedy_for_unseeded",
                  "speculative_on_greedy", "replayable_on_greedy", "overlong", "made_up_eos", "cut_short")
OVERLONG_ASKED, OVERLONG_MADE = 4, 32  # overlong: the max_tokens claimed against, and the honest run's
GROUP_SPLITS = {"group_tensor": ("llama-tiny", "auto"), "group_pipeline": ("qwen2-tiny", "pipeline")}
# Structured output: schemas with a regex, an enum, bounded numbers, an array and an optional field.
SCHEMAS = [
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "kind": {"enum": ["capital", "town", "village"]}}, "required": ["code", "kind"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}, "maxItems": 4},
                                      "paid": {"type": "boolean"}, "note": {"type": "string", "maxLength": 12}},
     "required": ["items", "paid"]},
]


def sampling_for(rng: random.Random, tokens: int, seeded: bool = True) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams(max_tokens=rng.randint(8, tokens), temperature=0.0)
    kw = rng.choice([{"top_p": rng.choice([0.8, 0.95])}, {"top_k": rng.choice([10, 40])},
                     {"min_p": rng.choice([0.02, 0.1])}, {}])
    return SamplingParams(max_tokens=rng.randint(8, tokens), temperature=round(rng.uniform(0.3, 1.2), 2),
                          seed=rng.randrange(1 << 31) if seeded else None,
                          logprobs=rng.choice([None, 2]), **kw)


def sampled(rng: random.Random, tokens: int) -> SamplingParams:
    """A seeded sampled job, as sampling_for draws them."""
    while (s := sampling_for(rng, tokens)).greedy:
        pass
    return s


def cheat_request(kind: str, rng: random.Random, tokens: int, i: int) -> SamplingParams:
    """The request a cheating job answers (the i-th of its kind): what the verifier is given as its sampling."""
    if kind in ("hotter", "other_seed"):
        return SamplingParams(max_tokens=tokens, temperature=0.7, seed=rng.randrange(1 << 31))
    if kind == "cheap_speculative":
        return SamplingParams(max_tokens=rng.randint(8, tokens), temperature=0.8, top_p=(0.95, 1.0)[i % 2],
                              seed=rng.randrange(1 << 31))
    if kind == "other_seed_replayable":
        return sampled(rng, tokens)
    if kind in ("greedy_for_sampled", "greedy_for_unseeded"):
        return SamplingParams(max_tokens=rng.randint(8, tokens), temperature=0.8,
                              seed=rng.randrange(1 << 31) if kind == "greedy_for_sampled" else None)
    if kind in ("speculative_on_greedy", "replayable_on_greedy"):
        return SamplingParams(max_tokens=rng.randint(8, tokens), temperature=0.0)
    if kind == "overlong":
        return dataclasses.replace(sampling_for(rng, tokens), max_tokens=OVERLONG_ASKED)
    return sampling_for(rng, tokens)  # greedy or seeded (made_up_eos and cut_short: the honest output cut)


def messages(rng: random.Random, system: bool = False) -> tuple:
    words = " ".join(rng.choice(fixtures.CORPUS.split()) for _ in range(rng.randint(3, 40)))
    return ((SYSTEM,) if system else ()) + ({"role": "user", "content": words},)


async def produce(node, model: str, jobs: list[Job]) -> list[tuple[Job, list[int], Done]]:
    async def one(job):
        ids, end = [], None
        async with node.run(dataclasses.replace(job, model=model)) as stream:
            async for ev in stream:
                ids += getattr(ev, "token_ids", ())
                end = ev
        return job, ids, end
    return await asyncio.gather(*(one(j) for j in jobs))


def read(verifier, model: str, job: Job, ids: list[int], proof: Proof) -> ClaimReader:
    """The claim read through the verifier's real model (its prompt templated as the producer did)."""
    prepared = verifier.prompts.prepare(dataclasses.replace(job, model=model)).result()
    asyncio.run(verifier.preload(model))
    lm = verifier.models.acquire(model)
    try:
        # The job's own grammar, compiled from its rules as for generating it (None for a job without rules).
        reader = ClaimReader(lm, Claim(prepared.prompt, tuple(ids), prepared.job.sampling, proof), prepared.grammar)
        while not reader.done:
            reader.step(512)
        return reader
    finally:
        verifier.models.release(model)


def group_outcomes(root: Path, path: str, family: str, split: str, rng: random.Random, args):
    """Honest token-id jobs through a committing group of two's rank 0 (its local API), 8 at a time."""
    leader, followers = start_group(root / "fx" / family, root / path, 2, "--group-split", split,
                                    env={"PROVIDER_COMMITMENTS": "on"})
    jobs = [Job(id=f"{path}{i}", model=family,
                prompt_ids=tuple(rng.randrange(1, 200) for _ in range(rng.randint(3, 60))),
                sampling=dataclasses.replace(sampling_for(rng, args.tokens), logprobs=None))
            for i in range(args.group)]

    def one(job: Job):
        s = job.sampling
        body = {"prompt": list(job.prompt_ids), "max_tokens": s.max_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p} | ({"seed": s.seed} if s.seed is not None else {})
        r = httpx.post(f"{leader.url}/v1/completions", headers=leader.headers, json=body, timeout=600)
        r.raise_for_status()
        p = r.json()["choices"][0]["proof"]
        return job, p["output_ids"], Proof(base64.b64decode(p["commitment"]), p["sampler"], p["seed"],
                                           end_token=p.get("end_token"))

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, jobs))
    finally:
        leader.stop()
        for f in followers:
            f.stop()


def image_outcomes(root: Path, rng: random.Random, args) -> list[tuple[str, bool, dict]]:
    """Honest image jobs made by a committing VLM node (its assistant speculating on half of them), each checked
    by a verify job (the request with its images, the claimed ids, the proof) on another node: (path, passed,
    verdict)."""
    import io

    import numpy as np
    from PIL import Image

    from provider.content import IMAGE_PART, ImageInput
    from provider.jobs import Claim as ClaimOf
    from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant
    from provider.types import SpecMode

    make_gemma4_vlm(root / "vlm")
    make_gemma4_vlm_assistant(root / "vlm-assistant", root / "vlm")
    producer = make_node({"vlm": root / "vlm"}, commitments="on", speculation_k=3, max_concurrent_jobs=8,
                         manager_kw={"drafters": {"vlm": root / "vlm-assistant"}})
    verifier = make_node({"vlm": root / "vlm"}, speculation="off")
    system = {"role": "system", "content": "You describe pictures for a catalogue, briefly and plainly. " * 3}

    def picture() -> ImageInput:
        w, h = rng.randint(24, 220), rng.randint(24, 220)
        pixels = np.random.default_rng(rng.randrange(1 << 31)).integers(0, 255, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, rng.choice(["PNG", "JPEG"]))
        return ImageInput(buf.getvalue())

    def job(i: int) -> Job:
        n = rng.choice([1, 1, 2])
        content = [dict(IMAGE_PART) for _ in range(n)] + [{"type": "text", "text": messages(rng)[0]["content"]}]
        rng.shuffle(content)
        msgs = ((system,) if rng.random() < 0.33 else ()) + ({"role": "user", "content": content},)
        return Job(id=f"img{i}", model="vlm", messages=msgs, images=tuple(picture() for _ in range(n)),
                   sampling=dataclasses.replace(sampling_for(rng, args.tokens), logprobs=None),
                   speculation=rng.choice(["on", "off"]))

    async def main() -> list[tuple[str, bool, dict]]:
        out = []
        for start in range(0, args.images, 8):
            jobs = [job(start + i) for i in range(min(8, args.images - start))]
            for j, ids, end in await produce(producer, "vlm", jobs):
                assert isinstance(end, Done) and end.proof is not None, (j.id, end)
                check = dataclasses.replace(j, id=f"verify-{j.id}", verify=ClaimOf(tuple(ids), end.proof))
                _, _, verdict = (await produce(verifier, "vlm", [check]))[0]
                path = "images_mtp" if end.telemetry.speculation.mode is SpecMode.MTP else "images"
                passed = isinstance(verdict, Done) and verdict.verdict is not None and verdict.verdict.passed
                summary = verdict.verdict if isinstance(verdict, Done) else None
                out.append((path, passed, {"job": j.id, "end": repr(verdict)[:300],
                                           "ties": summary.ties if summary else 0,
                                           "tokens": summary.tokens if summary else 0}))
        return out

    async def run_and_stop():
        try:
            return await main()
        finally:
            await producer.stop()
            await verifier.stop()

    return asyncio.run(run_and_stop())


def forged(verifier, model: str, job: Job, ids: list[int], proof: Proof) -> Proof:
    """A commitment to `ids` (and the proof's end token after them) computed with the real weights: what a forger
    holding them can make for any output, by one forward of its own over prompt + output (not through a
    ClaimReader, which believes no claim before its commitment reads)."""
    prompt = verifier.prompts.prepare(dataclasses.replace(job, model=model)).result().prompt
    tokens = list(ids) + ([proof.end_token] if proof.end_token is not None else [])
    asyncio.run(verifier.preload(model))  # resident whichever cheats run first (--kinds)
    lm = verifier.models.acquire(model)
    try:
        tap = install(lm.model)
        lm.model(mx.array(list(prompt) + tokens)[None], cache=caches_for(lm))
        first = len(prompt) - 1  # the position whose forward gives output token 0
        indices, bits = top_entries(tap.last[0, first:first + len(tokens)])
        builder = CommitmentBuilder(tap.hidden_size)
        builder.add(np.array(indices), np.array(bits))
        return dataclasses.replace(proof, commitment=builder.finish(len(tokens)))
    finally:
        verifier.models.release(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--honest", type=int, default=2000)
    ap.add_argument("--cheats", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--group", type=int, default=200, help="honest jobs per split through a node group of two")
    ap.add_argument("--images", type=int, default=200, help="honest image jobs, checked by verify jobs")
    ap.add_argument("--kinds", default="", help="only these cheats (comma-separated names as printed)")
    args = ap.parse_args()
    every_kind = [*WEIGHT_CHEATS, "system_prompt", "drafter_alone", "hotter", "other_seed", "splice", *REQUEST_CHEATS]
    unknown = set(filter(None, args.kinds.split(","))) - set(every_kind)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; the kinds: {','.join(every_kind)}")
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fixtures.write_all(root / "fx")
        real, llama, draft = root / "fx" / "gemma4-tiny", root / "fx" / "llama-tiny", root / "fx" / "llama-tiny-draft"
        bad = {"noise_1pct": cheat_fixtures.noisy(real, root / "noisy", 0.01),
               "quantized_8bit": cheat_fixtures.quantized(real, root / "q8", 8),
               "quantized_4bit": cheat_fixtures.quantized(real, root / "q4", 4),
               "layer_dropped": cheat_fixtures.layer_dropped(real, root / "dropped", 1),
               # On llama-tiny most values move by less than rel_tol: the matched points' mean error catches it.
               "noise_1pct_llama": cheat_fixtures.noisy(llama, root / "noisy-llama", 0.01)}
        verifier = make_node({"g": real, "demo": DEMO_TARGET, "llama": llama, "llama-tiny": llama,
                              "qwen2-tiny": root / "fx" / "qwen2-tiny"}, commitments="on",
                             speculation="off", manager_kw={"max_resident": 8})
        producers = {
            "plain_chunk64": (make_node({"g": real}, commitments="on", speculation="off", prefill_step_size=64,
                                        max_concurrent_jobs=16), "g"),
            "plain_chunk2048": (make_node({"g": real}, commitments="on", speculation="off", prefill_step_size=2048,
                                          max_concurrent_jobs=16), "g"),
            "mtp": (make_node({"demo": DEMO_TARGET}, commitments="on", speculation="on",
                              manager_kw={"drafters": {"demo": DEMO_ASSISTANT}}, max_concurrent_jobs=16), "demo"),
            "draft_model": (make_node({"llama": llama}, commitments="on", speculation="on",
                                      manager_kw={"drafters": {"llama": draft}}, max_concurrent_jobs=16), "llama"),
        }
        cheat_node = make_node({**bad, "g": real, "draft": draft, "llama": llama}, commitments="on",
                               speculation="off", manager_kw={"max_resident": 8}, max_concurrent_jobs=16)
        report = {"honest": collections.Counter(), "honest_failures": [], "cheats": {},
                  "ties": {"total": 0, "tokens": 0, "most": 0, "most_in": None}}

        def honest(path: str, job_id: str, passed: bool, ties: int, tokens: int, failure: dict) -> None:
            report["honest"][(path, passed)] += 1
            if not passed:
                report["honest_failures"].append({"path": path, "job": job_id, **failure})
            t = report["ties"]  # near-ties (Verdict.ties) of every honest job, passed or not (issue 55)
            t["total"], t["tokens"] = t["total"] + ties, t["tokens"] + tokens
            if ties > t["most"]:
                t["most"], t["most_in"] = ties, {"path": path, "job": job_id, "tokens": tokens}

        # Honest: batches of 1 to 16 jobs, a quarter repeating an earlier prompt (a prefix hit).
        done, history = 0, []
        while done < args.honest:
            path = rng.choice(list(producers))
            node, model = producers[path]
            batch = []
            for i in range(min(rng.choice([1, 4, 16]), args.honest - done)):
                msgs = rng.choice(history) if history and rng.random() < 0.25 else messages(rng)
                history.append(msgs)
                structured = rng.random() < 0.25
                rules = OutputRules(ResponseFormat("json_schema", rng.choice(SCHEMAS), "out")) if structured \
                    else OutputRules()
                batch.append(Job(id=f"h{done + i}", model=model, messages=msgs, rules=rules,
                                 sampling=sampling_for(rng, args.tokens, seeded=path != "mtp" or rng.random() < 0.5)))
            for job, ids, end in asyncio.run(produce(node, model, batch)):
                assert isinstance(end, Done), end
                verdict = read(verifier, model, job, ids, end.proof).verdict()
                kind = path + ("+json_schema" if job.rules.constrained else "")
                honest(kind, job.id, verdict.passed, verdict.ties, verdict.tokens, verdict.summary())
            done += len(batch)
        for path, (family, split) in GROUP_SPLITS.items():  # a node group of two, each split
            for job, ids, proof in group_outcomes(root, path, family, split, rng, args):
                verdict = read(verifier, family, job, ids, proof).verdict()
                honest(path, job.id, verdict.passed, verdict.ties, verdict.tokens, verdict.summary())
        for path, passed, detail in image_outcomes(root, rng, args) if args.images else ():
            honest(path, detail["job"], passed, detail["ties"], detail["tokens"], detail)
        # Cheats.
        kinds = [k for k in every_kind if not args.kinds or k in args.kinds.split(",")]
        for kind in kinds:
            jobs_of = caught = at_start = raised = 0
            notes = []  # a few claims the verifier raised on, or failed elsewhere than where the cheat starts
            for n in range(0, args.cheats, 16):
                jobs = [Job(id=f"{kind}{n + i}", model="g", messages=messages(rng),
                            sampling=cheat_request(kind, rng, args.tokens, n + i))
                        for i in range(min(16, args.cheats - n))]
                results = _cheat(kind, jobs, cheat_node, verifier, rng, args.tokens)
                for ok, right_place, *note in results:  # ok None: the verifier raised instead of judging
                    jobs_of += 1
                    raised += ok is None
                    caught += ok is not None and not ok
                    at_start += ok is not None and not ok and right_place
                    if note and note[0] and len(notes) < 5:
                        notes.append(note[0])
            report["cheats"][kind] = {"jobs": jobs_of, "caught": caught, "caught_where_it_starts": at_start,
                                      **({"verifier_raised": raised} if raised else {}),
                                      **({"notes": notes} if notes else {})}
            print(f"{kind}: caught {caught}/{jobs_of}, where it starts {at_start}"
                  + (f", the verifier raised on {raised}" if raised else ""), flush=True)
        for node in (verifier, cheat_node, *(n for n, _ in producers.values())):
            asyncio.run(node.stop())  # before the interpreter exits: a live engine thread aborted it (134)
    honest_total = sum(report["honest"].values())
    false = sum(v for (_, passed), v in report["honest"].items() if not passed)
    print(f"honest: {honest_total} jobs, {false} false rejections; by path: "
          f"{ {p: v for (p, ok), v in report['honest'].items() if ok} }")
    t = report["ties"]
    print(f"honest near-ties: {t['total']} in {t['tokens']} tokens "
          f"({100 * t['total'] / max(1, t['tokens']):.3f} per 100 tokens), at most {t['most']} in one job"
          + (f" ({t['most_in']})" if t["most_in"] else ""))
    print(json.dumps({"honest_jobs": honest_total, "false_rejections": false, "honest_ties": t,
                      "cheats": report["cheats"],
                      "honest_failures": report["honest_failures"][:20], "seconds": round(time.perf_counter() - t0)}))
    worst = min((c["caught"] / c["jobs"] for c in report["cheats"].values() if c["jobs"]), default=1.0)
    return 0 if false == 0 and worst >= 0.999 else 1


def _cheat(kind, jobs, node, verifier, rng, tokens) -> list[tuple]:
    """(passed, failed where it starts[, a note or None]) for each cheating job, verified as the real model's ("g");
    passed None when the verifier raised instead of judging the claim."""
    out = []
    if kind in WEIGHT_CHEATS:
        for job, ids, end in asyncio.run(produce(node, kind, jobs)):
            v = read(verifier, WEIGHT_CHEATS[kind], job, ids, end.proof).verdict()
            out.append((v.passed, v.first_failure == 0))
    elif kind == "system_prompt":  # made with a system message, claimed without it
        made = asyncio.run(produce(node, "g", [dataclasses.replace(j, messages=(SYSTEM, *j.messages)) for j in jobs]))
        for job, (_, ids, end) in zip(jobs, made):
            v = read(verifier, "g", job, ids, end.proof).verdict()
            out.append((v.passed, v.first_failure == 0))
    elif kind == "drafter_alone":  # the draft model's output claimed as its target's
        for job, ids, end in asyncio.run(produce(node, "draft", jobs)):
            v = read(verifier, "llama", job, ids, end.proof).verdict()
            # The commitment is the drafter's hidden states from token 0, whatever its tokens: it starts there.
            out.append((v.passed, v.first_failure == 0))
    elif kind in ("hotter", "other_seed"):
        lie = [dataclasses.replace(j, sampling=dataclasses.replace(
            j.sampling, **({"temperature": 1.3} if kind == "hotter" else {"seed": j.sampling.seed + 1}))) for j in jobs]
        honest = asyncio.run(produce(node, "g", jobs))
        for (job, ids, end), (_, real_ids, _) in zip(asyncio.run(produce(node, "g", lie)), honest):
            claimed = dataclasses.replace(end.proof, seed=job.sampling.seed - (kind == "other_seed"))
            truthful = next(j for j in jobs if j.id == job.id)
            v = read(verifier, "g", truthful, ids, claimed).verdict()
            start = next((j for j, (a, b) in enumerate(zip(ids, real_ids)) if a != b), None)
            out.append((v.passed if start is not None else False, _from(v.first_failure, start), _note(job, v, start)))
    elif kind == "splice":  # k real tokens, then another model's; the commitment forged with the real weights
        greedy = [dataclasses.replace(j, sampling=SamplingParams(max_tokens=tokens, temperature=0.0)) for j in jobs]
        for job, real_ids, end in asyncio.run(produce(node, "g", greedy)):
            k = rng.randrange(1, max(2, len(real_ids)))
            prompt_ids = verifier.prompts.prepare(dataclasses.replace(job, model="g")).result().prompt
            tail = asyncio.run(produce(node, "layer_dropped", [Job(id=job.id + "t", model="layer_dropped",
                               prompt_ids=tuple(prompt_ids) + tuple(real_ids[:k]),
                               sampling=SamplingParams(max_tokens=tokens - k, temperature=0.0))]))[0][1]
            ids = real_ids[:k] + tail
            # The forger claims no end token: the real output's, if it had one, ended another output.
            proof = forged(verifier, "g", job, ids, dataclasses.replace(end.proof, end_token=None))
            v = read(verifier, "g", job, ids, proof).verdict()
            start = next((j for j, (a, b) in enumerate(zip(ids, real_ids)) if a != b), None)
            out.append((v.passed if start is not None else False, _from(v.first_failure, start), _note(job, v, start)))
    elif kind in REQUEST_CHEATS:  # the claim's commitment forged with the real weights: only the request stops it
        for job, ids, proof, start in _request_cheats(kind, jobs, node, verifier, rng):
            try:
                v = read(verifier, "g", job, ids, forged(verifier, "g", job, ids, proof)).verdict()
            except Exception as e:  # noqa: BLE001 (no claim may make the verifier raise: counted, not caught)
                out.append((None, False, {"job": job.id, "start": start, "raised": f"{type(e).__name__}: {e}"[:200]}))
                continue
            # A contradiction of the request fails at position 0, as other weights do; a length or an ending
            # where the cheat starts (max_tokens; the cut), never before it.
            right = v.first_failure == 0 if start == 0 else _from(v.first_failure, start)
            note = None if not v.passed and right else {"job": job.id, "start": start, "passed": v.passed,
                                                        "first_failure": v.first_failure, "reason": v.reason,
                                                        "ties": v.ties}
            out.append((v.passed, right, note))
    return out


def _request_cheats(kind, jobs, node, verifier, rng) -> list[tuple[Job, list[int], Proof, int]]:
    """Each job's cheating claim: (the request, the claimed ids, the proof before its commitment is forged, the
    output position where the cheat starts). An honest output too short to cheat with (overlong's that fits
    max_tokens, a cut's shorter than 1 or 2 tokens) is made again for another prompt, up to 4 times."""
    asyncio.run(verifier.preload("g"))
    lm = verifier.models.acquire("g")
    limit, ends = lm.decodable or lm.logits_width, end_ids(lm.tokenizer, SamplingParams(max_tokens=1))
    eos = lm.tokenizer.eos_token_id if lm.tokenizer.eos_token_id in ends else min(ends)  # the model's EOS id
    verifier.models.release("g")
    if kind in ("speculative_on_greedy", "replayable_on_greedy"):  # random ids below the vocabulary, no end id
        out = []
        for job in jobs:
            ids = []
            while len(ids) < job.sampling.max_tokens:  # as long as the request allows: its length is right
                ids += [t] if (t := rng.randrange(limit)) not in ends else []
            proof = (Proof(None, SPECULATIVE_SAMPLER) if kind == "speculative_on_greedy"
                     else Proof(None, REPLAYABLE_SAMPLER, rng.randrange(1 << 31)))
            out.append((job, ids, proof, 0))
        return out
    # What the forger decodes instead of the request: which model, with which sampling.
    made_with = {"cheap_speculative": ("quantized_4bit", lambda s: s),  # the 4-bit copy, decoding the job itself
                 "other_seed_replayable": ("g", lambda s: dataclasses.replace(s, seed=(s.seed + 1) % (1 << 31))),
                 "greedy_for_sampled": ("g", lambda s: dataclasses.replace(s, temperature=0.0, seed=None)),
                 "greedy_for_unseeded": ("g", lambda s: dataclasses.replace(s, temperature=0.0, seed=None)),
                 "overlong": ("g", lambda s: dataclasses.replace(s, max_tokens=OVERLONG_MADE)),
                 "made_up_eos": ("g", lambda s: s), "cut_short": ("g", lambda s: s)}
    model, how = made_with[kind]
    out, todo = [], list(jobs)
    for _ in range(5):
        made = asyncio.run(produce(node, model, [dataclasses.replace(j, sampling=how(j.sampling)) for j in todo]))
        again = []
        for job, (_, ids, end) in zip(todo, made):
            assert isinstance(end, Done) and end.proof is not None, (job.id, end)
            claim = _claimed(kind, job, list(ids), end.proof, eos, rng)
            if claim is None:
                again.append(dataclasses.replace(job, messages=messages(rng)))
            else:
                out.append((job, *claim))
        if not (todo := again):
            break
    return out


def _claimed(kind, job, ids, proof, eos, rng) -> tuple[list[int], Proof, int] | None:
    """The claim a forger makes from the output it decoded: (ids, proof, where the cheat starts), or None when
    this output cannot make one."""
    if kind == "cheap_speculative":  # a seeded job's tokens declared unreplayable: checked for plausibility today
        return ids, dataclasses.replace(proof, sampler=SPECULATIVE_SAMPLER, seed=None), 0
    if kind in ("other_seed_replayable", "greedy_for_sampled", "greedy_for_unseeded"):
        return ids, proof, 0  # the run's own honest label (replayable with the other seed; greedy)
    if kind == "overlong":  # the end token counts: it was generated
        asked = job.sampling.max_tokens
        return (ids, proof, asked) if len(ids) + (proof.end_token is not None) > asked else None
    if kind == "made_up_eos" and ids:
        k = rng.randrange(len(ids))
        return ids[:k], dataclasses.replace(proof, end_token=eos), k
    if kind == "cut_short" and len(ids) >= 2:  # an empty output needs an end token (jobs.Claim): k >= 1
        k = rng.randrange(1, len(ids))
        return ids[:k], dataclasses.replace(proof, end_token=None), k
    return None


def _note(job: Job, v, start: int | None) -> dict | None:
    """What to say of a cheat that passed or failed elsewhere than where it starts."""
    if start is None or (not v.passed and _from(v.first_failure, start)):
        return None
    return {"job": job.id, "start": start, "first_failure": v.first_failure, "reason": v.reason, "ties": v.ties}


def _from(failure: int | None, start: int | None) -> bool:
    """Caught where the cheat starts: never before its first token that differs from the real model's (an
    honest prefix is never blamed), at it, or past it by near-ties only (a token within the tie tolerance of the
    real model's choice is one a second honest run could give too)."""
    return start is None or (failure is not None and failure >= start)


if __name__ == "__main__":
    sys.exit(main())
