"""Images on a Gemma 4 checkpoint: the node's greedy tokens equal mlx-vlm's own `generate_step` on the same
images and messages, with speculation off and on (MTP after the multimodal prefill), alone and batched beside
text jobs; a model without a tower refuses images; prefix reuse never crosses images."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from provider.content import IMAGE_PART, ImageInput
from provider.jobs import Job
from provider.outputs import Done, Error
from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant
from provider.types import Cause, SpecMode
from tests.helpers import collect, greedy, make_node, run
from tools.harness.isolated import run_isolated

EOS = (2, 5)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm")
    make_gemma4_vlm(root / "gemma4-vlm")
    make_gemma4_vlm_assistant(root / "gemma4-vlm-assistant", root / "gemma4-vlm")
    return root


def image(w: int, h: int, seed: int, fmt: str = "PNG") -> tuple[bytes, Image.Image]:
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue(), Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


_reference_models: dict = {}


def reference(vlm: Path, messages: list[dict], images: list[Image.Image]) -> list[int]:
    """mlx-vlm's own greedy tokens: its processor on its template's text, its generate_step."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load

    if vlm not in _reference_models:
        _reference_models[vlm] = load(str(vlm / "gemma4-vlm"))
    model, processor = _reference_models[vlm]
    assert type(processor).__name__ == "Gemma4Processor"  # not HF's fallback
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, add_special_tokens=False)
    out = []
    for token, _ in generate_step(mx.array(inputs["input_ids"]), model, inputs.get("pixel_values"), None,
                                  max_tokens=MAX_TOKENS, temperature=0.0):
        out.append(int(token))
        if out[-1] in EOS:
            break
    return out


def as_job(job_id: str, messages: list[dict], files: list[bytes], speculation: str = "off", **kw) -> Job:
    """The node's job for messages whose {"type": "image"} parts take `files` in order."""
    parts = [{**m, "content": [dict(IMAGE_PART) if p == {"type": "image"} else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    return Job(id=job_id, model="vlm", sampling=greedy(MAX_TOKENS), speculation=speculation, messages=tuple(parts),
               images=tuple(ImageInput(f) for f in files), **kw)


def conversations() -> list[tuple[str, list[dict], list[tuple[bytes, Image.Image]]]]:
    small, wide, other = image(64, 64, 1), image(200, 120, 2), image(96, 160, 3, "JPEG")
    return [
        ("one image", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
         [small]),
        ("two sizes", [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                                    {"type": "text", "text": "and"}, {"type": "image"}]}],
         [small, wide]),
        ("earlier turn", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look."}]},
                          {"role": "assistant", "content": "I see it."},
                          {"role": "user", "content": "And now?"}], [other]),
    ]


def _node(vlm: Path, **kw):
    return make_node({"vlm": vlm / "gemma4-vlm"}, manager_kw={"drafters": {"vlm": vlm / "gemma4-vlm-assistant"}},
                     **kw)


def test_image_conversations_equal_mlx_vlm_with_speculation_off_and_on(vlm):
    cases = conversations()
    expected = {name: reference(vlm, msgs, [p for _, p in imgs]) for name, msgs, imgs in cases}
    assert len(set(map(tuple, expected.values()))) == len(cases)  # the images matter: outputs differ

    async def main():
        node = _node(vlm)
        try:
            for speculation, mode in (("off", SpecMode.OFF), ("on", SpecMode.MTP)):
                for name, msgs, imgs in cases:
                    ids, _, end, _ = await collect(node, as_job(f"{name}-{speculation}", msgs,
                                                                [f for f, _ in imgs], speculation))
                    assert isinstance(end, Done), end
                    assert ids == expected[name], (name, speculation)
                    assert end.telemetry.speculation.mode is mode
        finally:
            await node.stop()

    run(main())


def test_image_rows_batched_beside_text_rows_keep_their_tokens(vlm):
    cases = conversations()
    text = ({"role": "user", "content": "Tell me about caches."},)

    async def main():
        node = _node(vlm, max_concurrent_jobs=8)
        try:
            alone = (await collect(node, Job(id="alone", model="vlm", sampling=greedy(MAX_TOKENS), messages=text)))[0]
            jobs = [as_job(f"{name}-{s}", msgs, [f for f, _ in imgs], s)
                    for name, msgs, imgs in cases for s in ("off", "on")]
            jobs += [Job(id=f"text-{i}", model="vlm", sampling=greedy(MAX_TOKENS), messages=text) for i in range(3)]
            return alone, jobs, await asyncio.gather(*(collect(node, j) for j in jobs))
        finally:
            await node.stop()

    alone, jobs, results = run(main())
    expected = {name: reference(vlm, msgs, [p for _, p in imgs]) for name, msgs, imgs in cases}
    for job, (ids, _, end, _) in zip(jobs, results):
        assert isinstance(end, Done), (job.id, end)
        want = alone if job.id.startswith("text") else expected[job.id.rsplit("-", 1)[0]]
        assert ids == want, job.id


def test_prefix_reuse_takes_the_text_before_an_image_and_never_an_image(vlm):
    """Same system prompt and text, different images: the second reuses the system prompt's KV (cached tokens)
    but not the first image's (every image token has one id), and still equals its reference."""
    system = {"role": "system", "content": "You describe pictures for a catalogue, briefly and plainly. " * 3}
    a, b = image(64, 64, 4), image(64, 64, 5)
    msgs = [system, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]

    async def main():
        node = _node(vlm)
        try:
            return await collect(node, as_job("a", msgs, [a[0]])), await collect(node, as_job("b", msgs, [b[0]]))
        finally:
            await node.stop()

    first, second = run(main())
    assert first[0] == reference(vlm, msgs, [a[1]])
    assert second[0] == reference(vlm, msgs, [b[1]])
    assert first[0] != second[0]
    assert 0 < second[2].usage.cached_prompt_tokens < second[2].usage.prompt_tokens - 64


def test_a_model_without_a_vision_tower_refuses_images_and_keeps_serving(fixtures_dir):
    job = Job(id="img", model="g", sampling=greedy(4), images=(ImageInput(image(32, 32, 1)[0]),),
              messages=({"role": "user", "content": [dict(IMAGE_PART), {"type": "text", "text": "hi"}]},))
    text = Job(id="text", model="g", sampling=greedy(4), messages=({"role": "user", "content": "hi"},))

    async def main():
        node = make_node({"g": fixtures_dir / "gemma4-tiny"})
        try:
            return (await collect(node, job))[2], (await collect(node, text))[2]
        finally:
            await node.stop()

    refused, served = run(main())
    assert isinstance(refused, Error) and refused.cause is Cause.INVALID_REQUEST
    assert "takes no images" in refused.message
    assert isinstance(served, Done)


def test_detail_picks_the_budget_nearest_a_scaled_default():
    from provider.media.images import budget_for

    assert [budget_for(d, 280) for d in ("low", "auto", "high")] == [70, 280, 1120]
    assert [budget_for(d, 70) for d in ("low", "auto", "high")] == [70, 70, 280]
    assert budget_for("high", 560) == 1120


def _frames(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)) for _ in range(n)]


def _encoded(img: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def reference_video(vlm: Path, frames: list[Image.Image], fps: float, text: str) -> list[int]:
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load

    if vlm not in _reference_models:
        _reference_models[vlm] = load(str(vlm / "gemma4-vlm"))
    model, processor = _reference_models[vlm]
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    prompt = processor.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    clip = np.stack([np.asarray(f.convert("RGB")).transpose(2, 0, 1) for f in frames])
    inputs = processor(text=[prompt], videos=[clip], fps=[fps], add_special_tokens=False)
    out = []
    for token, _ in generate_step(mx.array(inputs["input_ids"]), model, None, None, max_tokens=MAX_TOKENS,
                                  temperature=0.0, pixel_values_videos=inputs["pixel_values_videos"],
                                  video_position_ids=inputs["video_position_ids"]):
        out.append(int(token))
        if out[-1] in EOS:
            break
    return out


def test_video_as_frames_and_as_an_animated_gif_equals_mlx_vlm(vlm):
    """Frames sent as images at a given rate, and a GIF whose frame duration (250 ms) gives 4 fps: both equal
    mlx-vlm's own tokens on the same frames and rate (the timestamps written into the prompt), MTP off and on."""
    from provider.content import VIDEO_PART, VideoInput

    frames = _frames(5)
    gif = _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    decoded = Image.open(io.BytesIO(gif))
    gif_frames = []
    for i in range(decoded.n_frames):
        decoded.seek(i)
        gif_frames.append(decoded.convert("RGB"))
    cases = [("frames", VideoInput(tuple(_encoded(f) for f in frames), 2.0), reference_video(vlm, frames, 2.0, "Go")),
             ("gif", VideoInput((gif,)), reference_video(vlm, gif_frames, 4.0, "Go"))]
    messages = ({"role": "user", "content": [dict(VIDEO_PART), {"type": "text", "text": "Go"}]},)

    async def main():
        node = _node(vlm)
        try:
            return [await collect(node, Job(id=f"{name}-{s}", model="vlm", sampling=greedy(MAX_TOKENS), speculation=s,
                                            messages=messages, videos=(video,)))
                    for name, video, _ in cases for s in ("off", "on")]
        finally:
            await node.stop()

    results = run(main())
    assert cases[0][2] != cases[1][2]
    for (name, _, want), got in zip([c for c in cases for _ in (0, 1)], results):
        assert isinstance(got[2], Done), got[2]
        assert got[0] == want, name


def test_a_long_video_is_sampled_to_the_frame_cap_at_its_real_rate():
    from provider.content import VideoInput
    from provider.media.decode import video_frames

    files = tuple(_encoded(f) for f in _frames(40, seed=1))
    frames, fps = video_frames(VideoInput(files, 8.0), cap=32)
    assert len(frames) == 32 and fps == pytest.approx(32 * 8.0 / 40)  # 40 frames at 8 fps last 5 s
    assert (len(frames) - 1) / fps < 5.0


def test_a_text_stream_keeps_decoding_while_an_image_prompt_is_read_and_a_cancelled_read_frees_its_job(vlm):
    """The image prompt is read a piece per engine pass (each image through the tower, then 16-token chunks), so
    a stream decoding beside it gets tokens between the image job's acceptance and its first token; a job
    cancelled mid-read ends cancelled and the node goes on (counted in tokens and events, not time)."""
    from provider.outputs import Accepted, Tokens
    from provider.types import FinishReason

    small, wide = image(64, 64, 1), image(200, 120, 2)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Both?"}]}]
    text = ({"role": "user", "content": "Tell me about caches."},)

    async def main():
        node = _node(vlm, prefill_step_size=16)
        order: list[str] = []
        try:
            async def stream_text():
                async with node.run(Job(id="text", model="vlm", sampling=greedy(400), messages=text)) as s:
                    async for ev in s:
                        if isinstance(ev, Tokens):
                            order.append("text")

            async def image_job():
                async with node.run(as_job("img", msgs, [small[0], wide[0]])) as s:
                    async for ev in s:
                        if isinstance(ev, Accepted):
                            order.append("accepted")
                        elif isinstance(ev, Tokens):
                            order.append("first")
                            return

            streaming = asyncio.create_task(stream_text())
            while order.count("text") < 3:
                await asyncio.sleep(0.01)
            await image_job()
            async with node.run(as_job("cancelled", msgs, [small[0], wide[0]])) as s:
                accepted = await s.__anext__()  # leaving the stream now cancels the job mid-read
            ended = await collect(node, as_job("after", msgs, [small[0], wide[0]]))
            streaming.cancel()
            return order, accepted, ended, node.status().active_jobs
        finally:
            await node.stop()

    order, accepted, after, _ = run(main())
    between = order[order.index("accepted"):order.index("first")].count("text")
    assert between >= 5, order  # read all at once, the stream would get none
    assert isinstance(accepted, Accepted)
    assert isinstance(after[2], Done) and after[0] == reference(vlm, msgs, [small[1], wide[1]])
    assert after[2].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def _encode_peaks(root: str) -> list[dict]:
    """Per detail level: MLX's peak over a warm encode of one image by the tower, and the scratch admission books
    for it (run in a process of its own: the figures are process-wide)."""
    import mlx.core as mx

    from provider.media.images import ImageProcessor
    from provider.memory.estimate import vision_scratch_bytes
    from provider.models.loader import load

    lm = load("gemma4-vlm", Path(root) / "gemma4-vlm")
    processor = ImageProcessor(Path(root) / "gemma4-vlm", lm.config, lm.tokenizer)
    out = []
    for detail in ("low", "auto", "high"):  # 70, 280 and 1120 soft tokens at most, by the fixture's default 70
        prepared = processor.prepare(ImageInput(image(320, 240, seed=4)[0], detail))
        mx.eval(lm.vision.encode(prepared.pixels))  # compiled and warm
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(lm.vision.encode(prepared.pixels))
        out.append({"detail": detail, "soft_tokens": prepared.soft_tokens, "held": mx.get_peak_memory() - before,
                    "booked": vision_scratch_bytes(lm.config, prepared.soft_tokens)})
    return out


def test_an_images_scratch_estimate_bounds_what_its_encode_holds(vlm):
    """Admission books `vision_scratch_bytes` per image: MLX's peak over the tower's encode stays under it."""
    for m in run_isolated(_encode_peaks, str(vlm)):
        assert 0 < m["held"] <= m["booked"], m
