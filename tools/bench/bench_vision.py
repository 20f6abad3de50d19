"""Image requests: the node vs `mlx_vlm.server` on the same Gemma 4 checkpoint, same machine, same run.

Both servers run at once on loopback, each with the checkpoint's MTP assistant (the node with
`--drafter`, mlx_vlm.server with `--draft-model --draft-kind mtp`) and each also without it (the node per
request, `speculation: off`; a second mlx_vlm.server with no drafter). Every round sends the same image
requests (a fresh random image each, so no side reuses a cached image) to each configuration in turn:

- c = 1: time to first token (median) and decode tokens/s (tokens after the first over the time they took,
  median), `--requests` requests one after another;
- c = 4: aggregate completion tokens/s with four clients;
- the node's telemetry: tokens per target forward on its speculating image requests (what MTP did);
- stall: a text stream decoding while an image request arrives: that stream's longest gap between tokens
  (the image's encode and prefill are what it waits behind).

Without --model it builds the fixture factory's tiny Gemma 4 VLM with a 280-token image budget and its
(random, so rarely accepted) assistant: the figures then compare the machinery, not a trained pair.

    python tools/bench/bench_vision.py [--model DIR --drafter DIR] [--requests 6] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.bench_vs_server import free_port  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402


def image_url(seed: int, size: tuple[int, int]) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


class Target:
    def __init__(self, name: str, url: str, model: str, headers: dict, extra: dict | None = None):
        self.name, self.url, self.model, self.headers, self.extra = name, url, model, headers, extra or {}
        self.per_forward: list[float] = []

    def ask(self, url: str | None, tokens: int, on_token=None) -> tuple[float, float, int]:
        """One streamed request, with an image unless `url` is None: (time to first token, decode tokens/s
        after it, completion tokens)."""
        content = [{"type": "text", "text": "Describe this picture."}]
        if url is not None:
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        body = {"model": self.model, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra,
                "messages": [{"role": "user", "content": content}]}
        t0 = time.perf_counter()
        first = last = None
        n = 0
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers,
                          timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    if on_token:
                        on_token(last)
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                spec = (chunk.get("telemetry") or {}).get("speculation") or {}
                if spec.get("tokens_per_target_forward"):
                    self.per_forward.append(spec["tokens_per_target_forward"])
        if first is None:
            raise RuntimeError(f"{self.name}: no tokens")
        decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
        return first - t0, decode, n


def stall(target: Target, url: str) -> float:
    """A text stream's longest gap between tokens while an image request is read beside it."""
    times: list[float] = []
    started = threading.Event()

    def note(t: float) -> None:
        times.append(t)
        if len(times) == 8:
            started.set()

    stream = threading.Thread(target=lambda: target.ask(None, 160, note))
    stream.start()
    started.wait(300)
    target.ask(url, 4)
    stream.join()
    gaps = [b - a for a, b in zip(times[7:], times[8:])]
    return max(gaps) if len(gaps) > 4 else float("nan")  # a stream that ended early measured nothing


def start_vlm_server(model: Path, drafter: Path | None, port: int, log: Path):
    import os
    import subprocess

    args = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--port", str(port)]
    if drafter is not None:
        args += ["--draft-model", str(drafter), "--draft-kind", "mtp"]
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=os.environ | {"HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_vlm.server exited: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    raise TimeoutError("mlx_vlm.server did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--image", default="640x480", help="width x height of each random image")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    model, drafter = args.model, args.drafter
    if model is None:
        from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant

        model, drafter = work / "gemma4-vlm", work / "gemma4-vlm-assistant"
        make_gemma4_vlm(model, soft_tokens=280)
        make_gemma4_vlm_assistant(drafter, model)
    size = tuple(int(x) for x in args.image.split("x"))
    (work / "node").mkdir()
    node = LocalServer(model, work / "node", *(["--drafter", str(drafter)] if drafter else []))
    servers, targets = [], []
    try:
        targets += [Target("node MTP", node.url, model.name, node.headers, {"speculation": "on"}),
                    Target("node plain", node.url, model.name, node.headers, {"speculation": "off"})]
        for name, d in (("mlx_vlm MTP", drafter), ("mlx_vlm plain", None)):
            if name.endswith("MTP") and d is None:
                continue
            port = free_port()
            servers.append(start_vlm_server(model, d, port, work / f"{name.replace(' ', '-')}.log"))
            targets.append(Target(name, f"http://127.0.0.1:{port}", str(model), {}))
        for t in targets:  # warm: first loads, first compiles
            t.ask(image_url(0, size), 4)
        figures = {t.name: {"ttft": [], "decode": [], "c4": [], "stall": []} for t in targets}
        seed = 1
        for _ in range(args.rounds):
            for t in targets:
                for _ in range(args.requests):
                    ttft, decode, _n = t.ask(image_url(seed, size), args.tokens)
                    seed += 1
                    figures[t.name]["ttft"].append(ttft)
                    figures[t.name]["decode"].append(decode)
                urls = [image_url(seed + i, size) for i in range(8)]
                seed += 8
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    total = sum(n for _, _, n in pool.map(lambda u: t.ask(u, args.tokens), urls))
                figures[t.name]["c4"].append(total / (time.perf_counter() - start))
                figures[t.name]["stall"].append(stall(t, image_url(seed, size)))
                seed += 1
        print(f"\nimage {size[0]}x{size[1]}, {args.tokens} tokens, {args.rounds} rounds x {args.requests} requests; "
              f"model {model}")
        print(f"{'':15} {'TTFT p50 s':>11} {'decode tok/s':>13} {'c=4 tok/s':>10} {'stall s':>8} {'tok/target fwd':>15}")
        for t in targets:
            f = figures[t.name]
            per_forward = f"{statistics.median(t.per_forward):.2f}" if t.per_forward else "-"
            print(f"{t.name:15} {statistics.median(f['ttft']):11.3f} {statistics.median(f['decode']):13.1f} "
                  f"{statistics.median(f['c4']):10.1f} {statistics.median(f['stall']):8.3f} {per_forward:>15}")
        for ours, theirs in (("node MTP", "mlx_vlm MTP"), ("node plain", "mlx_vlm plain")):
            if theirs in figures:
                a, b = figures[ours], figures[theirs]
                print(f"{ours} / {theirs}: TTFT {statistics.median(a['ttft']) / statistics.median(b['ttft']):.2f}, "
                      f"decode {statistics.median(a['decode']) / statistics.median(b['decode']):.2f}, "
                      f"c=4 {statistics.median(a['c4']) / statistics.median(b['c4']):.2f}, "
                      f"stall {statistics.median(a['stall']) / statistics.median(b['stall']):.2f}")
    finally:
        node.stop()
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
