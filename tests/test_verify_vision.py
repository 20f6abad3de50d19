"""Image jobs as verified work (issue 39): a committing node's outcome for a job with images carries a proof of the
generated tokens' hidden states, and a verify job whose request carries those images is read as the job was made:
the same media decoding and bounds, the prompt prefilled with the tower's features by the engine's own vision
prefill, then the claimed output read and judged as text is. Real fixture checkpoints (the tiny Gemma 4 VLM and
its MTP assistant), two real nodes: one makes the claims, another checks them."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from provider.content import IMAGE_PART, ImageInput
from provider.jobs import Claim, Job, SamplingParams
from provider.outputs import Done, Error, Proof
from tools.fixtures import cheats as cheat_fixtures
from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant
from provider.types import Cause, SpecMode
from tests.helpers import collect, make_node, run
from tests.test_vision import image

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=21)
ONE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
TWO = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                    {"type": "text", "text": "and"}, {"type": "image"}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-verify")
    make_gemma4_vlm(root / "gemma4-vlm")
    make_gemma4_vlm_assistant(root / "gemma4-vlm-assistant", root / "gemma4-vlm")
    # The cheat: the same checkpoint, tower included, every weight 1% off (the factory copies the tokenizer's
    # files; the processor's config is the vision checkpoint's own).
    cheat_fixtures.noisy(root / "gemma4-vlm", root / "noisy-vlm")
    shutil.copy(root / "gemma4-vlm" / "processor_config.json", root / "noisy-vlm" / "processor_config.json")
    return root


def _job(job_id: str, messages: list[dict], files: list[bytes], sampling: SamplingParams, model: str = "vlm",
         speculation: str = "off", **kw) -> Job:
    parts = [{**m, "content": [dict(IMAGE_PART) if p == {"type": "image"} else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    return Job(id=job_id, model=model, sampling=sampling, messages=tuple(parts),
               images=tuple(ImageInput(f) for f in files), speculation=speculation, **kw)


def _video_job(job_id: str, sampling: SamplingParams) -> Job:
    from provider.content import VIDEO_PART, VideoInput
    from tests.test_vision import _encoded, _frames

    return Job(id=job_id, model="vlm", sampling=sampling, speculation="off",
               messages=({"role": "user", "content": [dict(VIDEO_PART), {"type": "text", "text": "Go"}]},),
               videos=(VideoInput(tuple(_encoded(f) for f in _frames(3)), 2.0),))


async def _produce(node, jobs: list[Job], ends: list | None = None) -> list[tuple[list[int], Proof]]:
    """Each job's (ids, proof), made together; `ends` takes their Done events."""
    outs = await asyncio.gather(*(collect(node, j) for j in jobs))  # batched together, as a node serves them
    if ends is not None:
        ends += [end for _, _, end, _ in outs]
    for job, (ids, _, end, _) in zip(jobs, outs):
        assert isinstance(end, Done), (job.id, end)
        assert end.proof is not None and end.proof.commitment is not None, (job.id, "no proof for an image job")
        assert ids, job.id
        want = SpecMode.MTP if job.speculation == "on" else SpecMode.OFF
        assert end.telemetry.speculation.mode is want, (job.id, end.telemetry.speculation)
    return [(ids, end.proof) for ids, _, end, _ in outs]


async def _verify(node, job: Job, ids: list[int], proof: Proof, model: str = "vlm"):
    """The claim as a verify job: the original request (its images too), the claimed ids and the proof."""
    claimed = Job(id=f"verify-{job.id}", model=model, sampling=job.sampling, messages=job.messages,
                  images=job.images, videos=job.videos, verify=Claim(tuple(ids), proof))
    tokens, _, end, _ = await collect(node, claimed)
    assert tokens == []  # a verify job makes no tokens
    return end


def test_honest_image_jobs_pass_a_verify_job_on_another_node(vlm):
    a, b, c = image(64, 64, 1)[0], image(200, 120, 2)[0], image(96, 160, 3, "JPEG")[0]
    jobs = [_job("one-greedy", ONE, [a], GREEDY), _job("one-seeded", ONE, [c], SEEDED),
            _job("two-greedy", TWO, [a, b], GREEDY), _job("two-seeded", TWO, [b, c], SEEDED),
            _job("one-mtp", ONE, [b], GREEDY, speculation="on"),  # MTP after the image prefill
            _job("two-mtp-seeded", TWO, [c, a], SEEDED, speculation="on"),  # coupled draws: still replayable
            _video_job("video-seeded", SEEDED),  # a video's frames are read by the same prefill
            Job(id="text", model="vlm", sampling=SEEDED, speculation="off",  # a text row beside the image rows
                messages=({"role": "user", "content": "Tell me about caches."},))]
    # Then one at a time, a system prompt before the image: the second job reads it from the prefix cache.
    system = {"role": "system", "content": "You describe pictures for a catalogue, briefly and plainly. " * 3}
    hits = [_job("system-a", [system, *ONE], [a], GREEDY), _job("system-b", [system, *TWO], [c, b], SEEDED)]

    async def main():
        producer = make_node({"vlm": vlm / "gemma4-vlm"}, commitments="on", speculation_k=3,
                             max_concurrent_jobs=8, manager_kw={"drafters": {"vlm": vlm / "gemma4-vlm-assistant"}})
        verifier = make_node({"vlm": vlm / "gemma4-vlm"}, speculation="off", prefill_step_size=16)
        try:
            claims, ends = await _produce(producer, jobs), []
            for job in hits:
                claims += await _produce(producer, [job], ends)
            assert ends[-1].usage.cached_prompt_tokens > 0  # the system prompt's KV, reused
            verdicts = [await _verify(verifier, job, ids, proof) for job, (ids, proof) in zip(jobs + hits, claims)]
            return claims, verdicts
        finally:
            await producer.stop()
            await verifier.stop()

    claims, verdicts = run(main())
    for job, (ids, proof), end in zip(jobs + hits, claims, verdicts):
        print(job.id, len(ids), end.verdict)  # the margins (docs/verification.md)
        assert proof.sampler == ("greedy" if job.sampling.greedy else "replayable"), job.id
        assert isinstance(end, Done) and end.verdict is not None, (job.id, end)
        assert end.verdict.passed, (job.id, end.verdict)
        read = len(ids) + (proof.end_token is not None)  # an output that ended on EOS: its end token is judged too
        assert end.verdict.tokens == read and end.verdict.min_overlap == 1.0, (job.id, end.verdict)
    assert len({tuple(ids) for ids, _ in claims}) == len(claims)  # the images matter: every output differs


def test_the_same_output_claimed_for_another_image_or_made_by_other_weights_fails_at_token_0(vlm):
    a, other = image(64, 64, 4)[0], image(64, 64, 5)[0]  # same size: the same prompt tokens, other pixels
    honest = _job("honest", ONE, [a], GREEDY)
    seeded = _job("seeded", TWO, [a, other], SEEDED)

    async def main():
        producer = make_node({"vlm": vlm / "gemma4-vlm", "noisy": vlm / "noisy-vlm"}, commitments="on",
                             speculation="off", max_concurrent_jobs=4)
        verifier = make_node({"vlm": vlm / "gemma4-vlm"}, speculation="off")
        try:
            (ids, proof), = await _produce(producer, [honest])
            cheats = await _produce(producer, [_job("cheat", ONE, [a], GREEDY, model="noisy"),
                                               _job("cheat-seeded", TWO, [a, other], SEEDED, model="noisy")])
            return {"honest": await _verify(verifier, honest, ids, proof),
                    "other image": await _verify(verifier, _job("other", ONE, [other], GREEDY), ids, proof),
                    "noisy": await _verify(verifier, honest, *cheats[0]),
                    "noisy seeded": await _verify(verifier, seeded, *cheats[1])}
        finally:
            await producer.stop()
            await verifier.stop()

    ends = run(main())
    assert ends["honest"].verdict.passed, ends["honest"].verdict
    for name in ("other image", "noisy", "noisy seeded"):
        v = ends[name].verdict
        print(name, v.reason, v.per_chunk[0])  # the margins (docs/verification.md)
        assert isinstance(ends[name], Done) and v is not None and not v.passed, (name, ends[name])
        assert v.first_failure == 0 and "hidden states" in v.reason, (name, v)
        assert v.per_chunk[0].overlap < 0.9 or v.per_chunk[0].mean_rel_err > 0.003, (name, v)


def test_a_verify_job_refuses_hostile_images_and_a_model_without_a_tower_as_a_job_would(vlm, fixtures_dir):
    data = image(64, 64, 6)[0]
    proof = Proof(b"\0" * 12, "greedy")  # refused before it is read

    async def main():
        node = make_node({"vlm": vlm / "gemma4-vlm", "text": fixtures_dir / "gemma4-tiny"}, speculation="off")
        try:
            ends = {}
            for name, files, model in (("corrupt", [b"\x89PNG\r\n\x1a\n" + b"\0" * 100], "vlm"),
                                       ("svg", [b"<svg/>"], "vlm"), ("no tower", [data], "text")):
                job = _job(name.replace(" ", "-"), ONE, files, GREEDY, model=model)
                made = (await collect(node, job))[2]
                checked = await _verify(node, job, [7, 8, 9], proof, model=model)
                ends[name] = (made, checked)
            return ends
        finally:
            await node.stop()

    for name, (made, checked) in run(main()).items():
        assert isinstance(checked, Error) and checked.cause is Cause.INVALID_REQUEST, (name, checked)
        assert isinstance(made, Error) and (made.cause, made.message) == (checked.cause, checked.message), name


def test_a_verify_jobs_images_are_booked_while_the_tower_reads_them(vlm, monkeypatch):
    """Whenever the tower encodes a claim's image, the model's booking holds, beyond what the claim's own read
    holds, the scratch of that encode and the pixels it reads, as for a job that generates; none once it ends."""
    import json

    from provider.memory.estimate import vision_scratch_bytes
    from provider.models.vision import VisionTower
    from provider.verification.verifier import ClaimReader

    config = json.loads((vlm / "gemma4-vlm" / "config.json").read_text())
    vc = config["vision_config"]
    node = make_node({"vlm": vlm / "gemma4-vlm"}, commitments="on", speculation="off")
    encodes, claim_reads = [], []
    real_encode, real_step = VisionTower.encode, ClaimReader.step

    def encode(self, pixels):  # spies: the ledger when the tower reads an image, and when the claim is read
        soft = pixels.shape[1] * pixels.shape[2] // vc["patch_size"] ** 2 // vc["pooling_kernel_size"] ** 2
        encodes.append({"booked": node.models.memory_status(0).jobs_kv_bytes, "pixels": pixels.nbytes,
                        "scratch": vision_scratch_bytes(config, soft)})
        return real_encode(self, pixels)

    def step(self, tokens):
        claim_reads.append(node.models.memory_status(0).jobs_kv_bytes)
        return real_step(self, tokens)

    job = _job("made", TWO, [image(200, 120, 7)[0], image(120, 200, 8)[0]], GREEDY)

    async def main():
        try:
            (ids, proof), = await _produce(node, [job])
            encodes.clear()
            monkeypatch.setattr(VisionTower, "encode", encode)
            monkeypatch.setattr(ClaimReader, "step", step)
            end = await _verify(node, job, ids, proof)
            assert node.status().memory.jobs_kv_bytes == 0
            return end
        finally:
            await node.stop()

    end = run(main())
    assert end.verdict.passed, end.verdict
    assert len(encodes) == 2 and claim_reads
    for s in encodes:
        assert s["booked"] >= min(claim_reads) + s["scratch"] + s["pixels"], (s, min(claim_reads))


def test_the_reference_coordinator_spot_checks_image_jobs_on_a_third_node_and_tallies_the_cheat(vlm, tmp_path):
    """Through the real wire: image jobs (plain and sealed) from an honest node and from one serving the VLM's
    weights 1% off under its name and hash, each checked by a verify job (the original request, its image bytes
    included) on a third node. The honest node's pass, the cheat's fail at token 0."""
    from coordinator_client.pb import provider_pb2 as pb
    from tests.test_verification_wire import spot_checked

    files = [image(64, 64, 9)[0], image(120, 80, 10)[0]]

    def request(job_id: str, i: int) -> pb.JobRequest:
        sampling = pb.SamplingParams(temperature=0.0) if i % 2 == 0 else pb.SamplingParams(temperature=0.8, seed=i)
        parts = [pb.ContentPart(image=pb.ImagePart(data=f, mime_type="image/png")) for f in files[:1 + i % 2]]
        parts.append(pb.ContentPart(text=f"What is it? {i}"))
        return pb.JobRequest(job_id=job_id, model="vlm", max_tokens=24, sampling=sampling,
                             speculation=pb.SPECULATION_POLICY_OFF,
                             chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", parts=parts)]))

    spot_checked(tmp_path, "vlm", vlm / "gemma4-vlm", vlm / "noisy-vlm", request, 3)
