"""Media bombs (issue 37): a few kilobytes that decode, or once decoded and scaled would, to gigabytes. Each is
refused with a 4xx naming its part or served within the media bound; the server's RSS sampled during each stays
within MAX_MEDIA_BYTES + 64 MiB over its idle baseline (plus the tower's booked scratch when it is served), the
preparation alone within MAX_MEDIA_BYTES + 64 MiB, and the node serves a normal request afterwards."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from provider.content import ImageInput, VideoInput
from provider.media.images import MAX_MEDIA_BYTES
from provider.media.decode import MAX_PIXELS
from provider.memory.estimate import vision_scratch_bytes
from tools.fixtures.vision import make_gemma4_vlm
from provider.types import JobError
from tests.helpers import LocalServer
from tools.harness.hostile import image_part, media_bombs
from tools.harness.isolated import run_isolated

SLACK = 64 << 20
REFUSED = 400
# What each bomb must get: a 400 whose message holds the fragment, or (None) served; the request-wide bound is
# the one check_media enforces wherever prompts are prepared (a 400, or served within the bound).
EXPECTED = {
    "gif frame at a large offset": (REFUSED, "at frame 1; at most 16,000,000 pixels are taken"),
    "gif frame past the pixel bound": (REFUSED, f"grows the canvas past the at most {MAX_PIXELS:,} pixels"),
    "gif frame at an offset under the canvas bound": (200, None),
    "gif frame at an offset, medium": (200, None),
    "gif frame at a large offset as an image": (200, None),
    "gif of many tiny frames": (REFUSED, "at most 10,000 are taken"),
    "gif of many frames on a large screen": (REFUSED, "are more than the at most 400,000,000 pixels"),
    "apng of many large frames": (REFUSED, "are more than the at most 400,000,000 pixels"),
    "animated webp of many large frames": (REFUSED, "are more than the at most 400,000,000 pixels"),
    "mpo with a large second picture": (REFUSED, f"grows the canvas past the at most {MAX_PIXELS:,} pixels"),
    "huge palette png": (200, None),
    "16-bit png": (200, None),
    "1-bit png": (200, None),
    "video of a large frame and tiny frames": (200, None),
    # 16 x 280 soft tokens pass the fixture's 4096-token context (a real model's would take them)
    "tiny images at high detail": (REFUSED, "shorten the prompt"),
    # past the request's media bound (check_media, before any decode) and the fixture's context (after)
    "tiny images and four videos": (REFUSED, ("more than the at most 256 MiB taken", "shorten the prompt")),
}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bombs")
    make_gemma4_vlm(root / "gemma4-vlm")
    return root


def _alternatives(fragment) -> tuple:
    return fragment if isinstance(fragment, tuple) else (fragment,)


def _request(parts: list[dict]) -> dict:
    return {"model": "gemma4-vlm", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]}


def _normal() -> dict:
    from PIL import Image

    from tools.harness.hostile import _png

    pixels = np.random.default_rng(3).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    return _request([image_part(_png(Image.fromarray(pixels)))])


def _peak_rss_during(pid: int, call):
    """call()'s result and the server's highest RSS sampled while it ran."""
    proc, done = psutil.Process(pid), threading.Event()
    peak = [proc.memory_info().rss]

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        return call(), peak[0]
    finally:
        done.set()
        t.join()


def test_media_bombs_are_refused_or_served_within_the_media_bound_and_the_node_keeps_serving(vlm):
    srv = LocalServer(vlm / "gemma4-vlm", vlm)
    try:
        def post(body: dict) -> httpx.Response:
            return httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(body).encode(), timeout=300,
                              headers={"Content-Type": "application/json", **srv.headers})

        for _ in range(2):  # warm: the tower compiled, MLX's cache and the allocator at their working size
            assert post(_normal()).status_code == 200
        idle = psutil.Process(srv.proc.pid).memory_info().rss
        config = json.loads((vlm / "gemma4-vlm" / "config.json").read_text())
        # the tower's largest call: a video's 32 frames of 70 soft tokens at once, or one image at high detail
        tower = max(32 * vision_scratch_bytes(config, 70), vision_scratch_bytes(config, 280))
        bombs = media_bombs()
        assert {name for name, _ in bombs} == set(EXPECTED)
        for name, parts in bombs:
            status, fragment = EXPECTED[name]
            r, peak = _peak_rss_during(srv.proc.pid, lambda: post(_request(parts)))
            if status is not None:
                assert r.status_code == status, (name, r.status_code, r.text[:300])
            if r.status_code == REFUSED:
                error = r.json()["error"]
                assert any(f in error["message"] for f in _alternatives(fragment)), (name, error)
                assert error["param"].startswith("messages"), (name, error)
            else:
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, (name, r.text[:300])
            # a served request also holds the tower's scratch while it encodes (booked by admission, not here)
            allowed = MAX_MEDIA_BYTES + SLACK + (tower if r.status_code == 200 else 0)
            grown = peak - idle
            print(f"{name}: {r.status_code}, RSS +{grown / 2**20:.0f} MiB (at most {allowed / 2**20:.0f})")
            assert grown <= allowed, f"{name}: RSS grew {grown / 2**20:.0f} MiB during the request"
            after = post(_normal())
            assert after.status_code == 200, (name, after.text[:300])
    finally:
        assert srv.stop() == 0


def _prepare_peaks(root: str) -> list[dict]:
    """Each bomb prepared on the fixture's processor in this process (check_media first, as a job's preparation
    does): the outcome, the prepared bytes against the headers' count, and the peak RSS over the start."""
    from mlx_lm.utils import load_tokenizer

    from provider.media.images import ImageProcessor
    from provider.local.image_parts import content_parts

    path = Path(root) / "gemma4-vlm"
    config = json.loads((path / "config.json").read_text())
    processor = ImageProcessor(path, config, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))
    out = []
    for name, parts in media_bombs():
        images: list = []
        videos: list = []
        content_parts(parts, "messages[0]", images, videos)
        start = psutil.Process().memory_info().rss

        def prepare():
            try:
                counted = processor.check_media(tuple(images), tuple(videos))
                held = [processor.prepare(i).nbytes for i in images] + \
                    [processor.prepare_video(v).nbytes for v in videos]
                return {"counted": list(counted), "held": held}
            except JobError as e:
                return {"refused": e.message, "param": e.param}

        outcome, peak = _peak_rss_during(os.getpid(), prepare)
        print(f"{name}: peak RSS +{(peak - start) / 2**20:.0f} MiB", file=sys.stderr)
        out.append({"name": name, **outcome, "grown": peak - start})
    return out


def test_preparing_each_bomb_holds_at_most_the_media_bound_and_no_more_than_its_headers_counted(vlm):
    """In a process of its own (RSS is process-wide): each bomb's preparation grows the peak RSS by at most
    MAX_MEDIA_BYTES + 64 MiB, each served part holds no more bytes than check_media counted from its headers,
    and what a refused bomb is refused for is the expected bound."""
    for m in run_isolated(_prepare_peaks, str(vlm)):
        status, fragment = EXPECTED[m["name"]]
        assert m["grown"] <= MAX_MEDIA_BYTES + SLACK, m
        if "refused" in m:
            assert any(f in m["refused"] for f in _alternatives(fragment)) and m["param"].startswith("messages[0].content["), m
        else:
            assert status == 200 or "shorten the prompt" in fragment, m
            assert all(0 < held <= counted for held, counted in zip(m["held"], m["counted"])), m


def _processor(vlm: Path):
    from mlx_lm.utils import load_tokenizer

    from provider.media.images import ImageProcessor

    path = vlm / "gemma4-vlm"
    config = json.loads((path / "config.json").read_text())
    return ImageProcessor(path, config, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))


def test_a_requests_media_are_counted_as_float32_from_their_headers_and_refused_past_the_bound(vlm):
    """A 69-byte PNG at high detail is scaled up to fill its budget, as the processor does (mlx-vlm's and HF's
    rule): check_media counts exactly the float32 bytes `prepare` then holds, and a request whose parts pass
    the bound is refused naming the part that passes it, before any is decoded."""
    from PIL import Image

    from tools.harness.hostile import _png

    processor = _processor(vlm)
    tiny = ImageInput(_png(Image.new("RGB", (1, 1))), "high", "messages[0].content[0]")
    counted = processor.check_media((tiny,))
    prepared = processor.prepare(tiny)
    assert counted == (prepared.nbytes,) and prepared.pixels.dtype == np.float32
    assert prepared.nbytes == 3 * 4 * prepared.pixels.shape[1] * prepared.pixels.shape[2] > 1000 * len(tiny.data)
    many = tuple(ImageInput(tiny.data, "high", f"messages[0].content[{i}]") for i in range(16))
    processor.max_media_bytes = 5 * prepared.nbytes + 1
    with pytest.raises(JobError) as e:
        processor.check_media(many)
    assert e.value.param == "messages[0].content[5]" and "MiB taken" in e.value.message


def test_video_frames_are_each_resized_to_the_processors_size_never_to_another_frames():
    """A 5656x5656 first frame and 1x1 frames: every frame comes out at the size the processor reads the first
    at, none at the first's own size; the same for a GIF whose later frames grow its canvas."""
    from PIL import Image

    from provider.media.decode import video_frames
    from tools.harness.hostile import _png, gif_with_frames

    fit = lambda w, h: (min(w, 96), min(h, 96))  # noqa: E731 - the processor's rule is exercised by the server
    big, tiny = _png(Image.new("1", (5656, 5656))), _png(Image.new("RGB", (1, 1)))
    frames, _ = video_frames(VideoInput((big,) + (tiny,) * 7, 2.0), 32, fit)
    assert [f.size for f in frames] == [(96, 96)] * 8
    gif = gif_with_frames((10, 10), [(0, 0, 10, 10)] + [(1490, 1490, 10, 10)] * 5)
    frames, _ = video_frames(VideoInput((gif,)), 32, fit)
    assert [f.size for f in frames] == [(10, 10)] * 6
