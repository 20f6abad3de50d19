"""Images through the local API, started with the README's command (`provider start --local --model DIR
--drafter DIR`): the official SDK's image parts are served; every hostile image is a 4xx naming its part,
after which a good image request is served; a URL is refused without any outbound connection."""

from __future__ import annotations

import base64
import io
import json
import socket
import zlib
import struct

import httpx
import numpy as np
import pytest
from PIL import Image

from provider.content import MAX_IMAGE_BYTES, MAX_IMAGES
from provider.media.decode import MAX_PIXELS
from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant
from tests.helpers import LocalServer


def encoded(w: int, h: int, fmt: str = "PNG", seed: int = 0, **save) -> bytes:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def body(*urls: str, text: str = "What is it?", **kw) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": "gemma4-vlm", "messages": [{"role": "user", "content": parts}], "max_tokens": 6,
            "temperature": 0} | kw


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-api")
    make_gemma4_vlm(root / "gemma4-vlm")
    make_gemma4_vlm_assistant(root / "gemma4-vlm-assistant", root / "gemma4-vlm")
    srv = LocalServer(root / "gemma4-vlm", root, "--drafter", str(root / "gemma4-vlm-assistant"))
    yield srv
    assert srv.stop() == 0


def _post(server, payload: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", content=json.dumps(payload).encode(),
                      headers={"Content-Type": "application/json", **server.headers}, timeout=120)


def _served(server) -> None:
    r = _post(server, body(data_url(encoded(48, 48, seed=9))))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_sdk_sends_images_in_every_format_and_speculation_covers_them(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=server.token)

    def ask(url: str, detail: str = "auto", **kw):
        return client.chat.completions.create(
            model="gemma4-vlm", max_tokens=6, temperature=0, **kw,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": detail}},
                                                   {"type": "text", "text": "Describe it."}]}])

    formats = [("PNG", "image/png", {}), ("JPEG", "image/jpeg", {}), ("WEBP", "image/webp", {}),
               ("GIF", "image/gif", {"save_all": True, "append_images": [Image.new("RGB", (40, 30), "red")]})]
    for fmt, mime, save in formats:
        r = ask(data_url(encoded(40, 30, fmt, seed=3, **save), mime))
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1, fmt
    url = data_url(encoded(200, 150, seed=4))
    tokens = {detail: ask(url, detail).usage.prompt_tokens for detail in ("low", "auto", "high")}
    assert tokens["low"] <= tokens["auto"] < tokens["high"], tokens  # the fixture's default is the least budget
    r = ask(data_url(encoded(64, 64)), extra_body={"speculation": "on"})
    assert r.model_extra["telemetry"]["speculation"]["mode"] == "mtp"


def test_two_images_give_two_answers_and_an_image_changes_the_answer(server):
    texts = []
    for urls in ([data_url(encoded(64, 64, seed=1))], [data_url(encoded(64, 64, seed=2))], []):
        r = _post(server, body(*urls, max_tokens=8))
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert len(set(texts)) == 3


HOSTILE = [
    ("not an image", data_url(b"hello, world" * 10), 400, "is not a PNG, JPEG, WebP or GIF"),
    ("corrupt PNG", data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), 400, "messages[0].content[0]"),
    ("truncated PNG", data_url(encoded(300, 200)[:2000]), 400, "truncated or corrupt"),
    ("truncated JPEG", data_url(encoded(300, 200, "JPEG")[:1500], "image/jpeg"), 400, "truncated or corrupt"),
    ("decompression bomb", data_url(png_header_only(40_000, 40_000)), 400, f"at most {MAX_PIXELS:,} pixels"),
    ("zero-sized", data_url(png_header_only(0, 10)), 400, "messages[0].content[0]"),
    ("svg", "data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
     400, "SVG images are not supported"),
    ("svg labelled png", data_url(b"<svg xmlns='http://www.w3.org/2000/svg'><script/></svg>"), 400, "is not a PNG"),
    ("not base64", "data:image/png;base64,@@@not-base64@@@", 400, "not valid base64"),
    ("not base64-encoded", "data:image/png,rawbytes", 400, "must be base64-encoded"),
    ("text mime", "data:text/plain;base64,aGVsbG8=", 400, "data URL's type must be one of"),
    ("empty", "data:image/png;base64,", 400, "the image is empty"),
    ("file URL", "file:///etc/passwd", 400, "does not fetch URLs"),
    ("oversized", data_url(b"\0" * (MAX_IMAGE_BYTES + 1)), 400, f"{MAX_IMAGE_BYTES >> 20} MiB"),
    ("far oversized", data_url(b"\0" * (MAX_IMAGE_BYTES + (1 << 20))), 400, "larger than"),
]


@pytest.mark.parametrize("name,url,status,message", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_a_hostile_image_is_a_4xx_naming_its_part_and_the_node_keeps_serving(server, name, url, status, message):
    r = _post(server, body(url))
    assert r.status_code == status, (name, r.text)
    error = r.json()["error"]
    assert message in error["message"], (name, error)
    assert error["param"].startswith("messages"), error
    _served(server)


def test_tokenize_counts_an_images_soft_tokens_as_its_completion_does(server):
    request = body(data_url(encoded(64, 48, seed=3)))
    tokens = httpx.post(server.url + "/tokenize", json={"model": "gemma4-vlm", "messages": request["messages"]},
                        headers=server.headers, timeout=120)
    assert tokens.status_code == 200, tokens.text
    completion = _post(server, request).json()
    soft = tokens.json()["tokens"].count(8)  # the image token, once per soft token: 63 of the budget's 70 at 4:3
    assert 0 < soft <= 70 and tokens.json()["count"] == completion["usage"]["prompt_tokens"] > soft
    bad = httpx.post(server.url + "/tokenize", json={"messages": body(data_url(b"not an image"))["messages"]},
                     headers=server.headers, timeout=120)
    assert bad.status_code == 400 and "messages[0].content[0]" in bad.json()["error"]["message"], bad.text


def test_too_many_images_bad_detail_and_placeholder_text_are_refused(server):
    url = data_url(encoded(32, 32))
    r = _post(server, body(*[url] * (MAX_IMAGES + 1)))
    assert r.status_code == 400 and f"at most {MAX_IMAGES} images" in r.json()["error"]["message"]
    bad = body(url)
    bad["messages"][0]["content"][0]["image_url"]["detail"] = "ultra"
    assert _post(server, bad).status_code == 400
    r = _post(server, body(url, text="Look at <|image|> this"))  # the placeholder typed by a client
    assert r.status_code == 400 and "image placeholders" in r.json()["error"]["message"]
    _served(server)


def test_an_http_url_is_refused_and_nothing_is_fetched(server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(1.0)
    port = listener.getsockname()[1]
    try:
        for url in (f"http://127.0.0.1:{port}/cat.png", f"https://127.0.0.1:{port}/cat.png"):
            r = _post(server, body(url))
            assert r.status_code == 400 and "does not fetch URLs" in r.json()["error"]["message"]
        with pytest.raises(socket.timeout):
            listener.accept()  # no connection was attempted
    finally:
        listener.close()
    _served(server)


def _video_body(part: dict) -> dict:
    return {"model": "gemma4-vlm", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]}


def test_videos_are_served_and_hostile_ones_refused(server):
    frames = [data_url(encoded(48, 32, seed=i)) for i in range(3)]
    r = _post(server, _video_body({"type": "video", "video": frames, "fps": 1}))
    assert r.status_code == 200, r.text
    gif_frames = [Image.new("RGB", (1, 1), (i % 2 * 255, 0, 0)) for i in range(10_001)]
    buf = io.BytesIO()
    gif_frames[0].save(buf, "GIF", save_all=True, append_images=gif_frames[1:], duration=10)
    cases = [
        ({"type": "video", "video": frames * 22}, "1 to 64 frame"),
        ({"type": "video", "video": frames, "fps": 0}, "fps must be a number"),
        ({"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}, "does not fetch URLs"),
        ({"type": "video_url", "video_url": {"url": data_url(buf.getvalue(), "image/gif")}}, "at most 10,000 are taken"),
        ({"type": "video", "video": [frames[0], data_url(b"not an image")]}, "is not a PNG"),
    ]
    for part, message in cases:
        r = _post(server, _video_body(part))
        assert r.status_code == 400 and message in r.json()["error"]["message"], (message, r.text)
    _served(server)
