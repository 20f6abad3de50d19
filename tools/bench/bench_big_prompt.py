"""Head-of-line blocking: a short request's time to first token alone vs beside a multi-megabyte prompt.

Runs the node daemon on the bundled default model and, in alternating rounds, times a short streaming request
alone and then sent while another client posts a 3 MB prompt (which the node must refuse without stalling
anyone). Prints the medians, their ratio (goal: <= 2), what the big request got, and the node's RSS.

    python tools/bench/bench_big_prompt.py [--rounds 7] [--megabytes 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

SHORT = {"prompt": "The provider node serves", "max_tokens": 8, "temperature": 0, "stream": True}


def ttft(srv: LocalServer) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", srv.url + "/v1/completions", json=SHORT, headers=srv.headers, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":' in line and '"text":""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("no token")


def big(srv: LocalServer, body: bytes, out: dict) -> None:
    started = time.perf_counter()
    r = httpx.post(srv.url + "/v1/completions", content=body, timeout=300,
                   headers=srv.headers | {"Content-Type": "application/json"})
    out.update(status=r.status_code, seconds=time.perf_counter() - started,
               error=r.json().get("error", {}).get("message", "")[:160])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--megabytes", type=float, default=3.0)
    args = ap.parse_args()
    if args.rounds < 1 or not 0 < args.megabytes <= 3.9:
        ap.error("--rounds must be >= 1 and --megabytes from 0 to 3.9 (the default body limit is 4 MiB)")
    model = ensure_default_model()
    body = json.dumps({"prompt": "word " * int(args.megabytes * 2**20 / 5), "max_tokens": 4}).encode()
    alone, beside, outcomes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        srv = LocalServer(model, Path(tmp))
        proc = psutil.Process(srv.proc.pid)
        try:
            ttft(srv)  # warm
            rss_start, rss_peak = proc.memory_info().rss, 0
            for _ in range(args.rounds):
                alone.append(ttft(srv))
                out: dict = {}
                t = threading.Thread(target=big, args=(srv, body, out))
                t.start()
                time.sleep(0.05)  # the big body is on the wire and being read when the short one arrives
                beside.append(ttft(srv))
                t.join()
                outcomes.append(out)
                rss_peak = max(rss_peak, proc.memory_info().rss)
        finally:
            srv.stop()
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"model {model.name}; {args.rounds} rounds, alternating; big prompt {len(body) / 2**20:.1f} MB")
    print(f"  short request TTFT alone        median {a * 1000:7.1f} ms  (min {min(alone) * 1000:.1f}, "
          f"max {max(alone) * 1000:.1f})")
    print(f"  short request TTFT beside big   median {b * 1000:7.1f} ms  (min {min(beside) * 1000:.1f}, "
          f"max {max(beside) * 1000:.1f})")
    print(f"  ratio beside / alone            {b / a:.2f}  (goal <= 2)")
    statuses = sorted({o['status'] for o in outcomes})
    print(f"  big request: status {statuses}, median {statistics.median(o['seconds'] for o in outcomes):.2f} s: "
          f"{outcomes[0]['error']}")
    print(f"  node RSS {rss_start / 2**20:.0f} MiB, peak seen {rss_peak / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
