"""What the node's page costs the node's decoding (issue 58: with the page open and updating, decode tokens/s
÷ without it ≥ 0.98).

Starts `provider start --local` (the bundled model unless --model) and runs the same greedy job again and again
(max_tokens --tokens, speculation as --speculation says), alternating rounds without the page and with it, in
ABBA order so a drift of the machine falls on both alike. "With the page" is what an open page does to the node:
a client polling GET /ui/state once a second with the page's session cookie, from a thread of this process
(`--browser`: a real headless chromium showing the page instead, whose own rendering then shares the machine's
cores with the node, as it does on an operator's laptop). Prints each round, then per condition the median and
mean of the engine's decode tokens/s (each job's telemetry) and of tokens/s by the wall clock, their ratios, and
the load average before and after.

    python -m tools.bench.bench_dashboard [--model DIR] [--pairs 8] [--tokens 192] [--browser]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tools.harness import browser as harness
from tools.harness.daemon import LocalServer

PROMPT = "Write a long, detailed story about a lighthouse keeper and the ships she watches over."
POLL_S = 1.0  # the page's rate (app.js POLL_MS)


class Poller:
    """The page's own traffic: GET /ui/state?since=N every second with the session cookie, while `on`."""

    def __init__(self, url: str, link: str):
        self.url = url
        self.client = httpx.Client(timeout=30)
        assert self.client.get(link, follow_redirects=True).status_code == 200, "the login link did not sign in"
        self.on = threading.Event()
        self.polls, self.latencies, self.seq = 0, [], 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            started = time.perf_counter()
            r = self.client.get(f"{self.url}/ui/state", params={"since": self.seq},
                                headers={"Sec-Fetch-Site": "same-origin"})
            r.raise_for_status()
            history = r.json()["history"]
            if history:
                self.seq = history[-1]["seq"]
            self.latencies.append(time.perf_counter() - started)
            self.polls += 1
            time.sleep(max(0.0, POLL_S - (time.perf_counter() - started)))


class PageInBrowser:
    """A headless chromium with the page open (`on`) or on about:blank (off)."""

    def __init__(self, url: str, link: str):
        self.url = url
        self.browser = harness.Browser()
        self.browser.get(link)
        self.browser.wait(lambda: (self.browser.field("link") or "").startswith("live"), "live figures", 30)

    def set(self, on: bool) -> None:
        self.browser.get(f"{self.url}/" if on else "about:blank")
        if on:
            self.browser.wait(lambda: (self.browser.field("link") or "").startswith("live"), "live figures", 30)


def one_job(server, tokens: int, speculation: str) -> tuple[float, float, int]:
    started = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=600, json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 0,
        "speculation": speculation})
    wall = time.perf_counter() - started
    r.raise_for_status()
    body = r.json()
    n = body["usage"]["completion_tokens"]
    return body["telemetry"]["decode_tokens_per_s"], n / wall, n


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):8.2f}  mean {statistics.fmean(values):8.2f}  " \
           f"min {min(values):8.2f}  max {max(values):8.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    ap.add_argument("--pairs", type=int, default=8, help="rounds of each condition (default 8)")
    ap.add_argument("--tokens", type=int, default=192, help="max_tokens of each job (default 192)")
    ap.add_argument("--speculation", choices=["off", "auto", "on"], default="off",
                    help="the jobs' speculation (default off: plain decoding, the steadiest rate)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between switching and the job (default 2)")
    ap.add_argument("--browser", action="store_true", help="a real headless chromium showing the page")
    ap.add_argument("--json", type=Path, help="also write the rounds and the summary here")
    a = ap.parse_args()
    if a.browser and harness.available():
        print(f"bench_dashboard: {harness.available()}", file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="provider-bench-page-") as home:
        server = LocalServer(a.model, Path(home))
        page = None
        try:
            link = harness.login_link(server)
            page = PageInBrowser(server.url, link) if a.browser else Poller(server.url, link)
            switch = page.set if a.browser else (lambda on: page.on.set() if on else page.on.clear())
            switch(False)
            for _ in range(2):  # warm-up: the first jobs pay for compiling, caches, the speculation profile
                one_job(server, a.tokens, a.speculation)
            order = [on for i in range(a.pairs) for on in ((False, True) if i % 2 == 0 else (True, False))]
            rounds = {False: [], True: []}
            for i, on in enumerate(order):
                switch(on)
                time.sleep(a.settle)
                engine, wall, n = one_job(server, a.tokens, a.speculation)
                rounds[on].append((engine, wall))
                print(f"round {i + 1:2d} page {'on ' if on else 'off'}: {engine:8.2f} tokens/s decode (engine), "
                      f"{wall:8.2f} tokens/s wall, {n} tokens", flush=True)
            switch(False)
        finally:
            if page is not None and a.browser:
                page.browser.quit()
            server.stop()
    load_after = os.getloadavg()
    off_e, on_e = [r[0] for r in rounds[False]], [r[0] for r in rounds[True]]
    off_w, on_w = [r[1] for r in rounds[False]], [r[1] for r in rounds[True]]
    how = "a headless chromium showing the page" if a.browser else "a client polling /ui/state every second"
    print(f"\npage open = {how}; {a.pairs} rounds each, ABBA; max_tokens {a.tokens}, speculation {a.speculation}")
    print(f"decode tokens/s (engine)  page off: {summary(off_e)}")
    print(f"decode tokens/s (engine)  page on:  {summary(on_e)}")
    print(f"tokens/s (wall clock)     page off: {summary(off_w)}")
    print(f"tokens/s (wall clock)     page on:  {summary(on_w)}")
    ratio_e = statistics.median(on_e) / statistics.median(off_e)
    ratio_w = statistics.median(on_w) / statistics.median(off_w)
    print(f"ratio on/off (medians): decode {ratio_e:.4f}, wall {ratio_w:.4f} "
          f"(means: {statistics.fmean(on_e) / statistics.fmean(off_e):.4f}, "
          f"{statistics.fmean(on_w) / statistics.fmean(off_w):.4f}); target >= 0.98")
    if not a.browser:
        lat = sorted(page.latencies)
        print(f"/ui/state: {page.polls} polls, latency p50 {lat[len(lat) // 2] * 1000:.2f} ms, "
              f"max {lat[-1] * 1000:.2f} ms")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (2 cores)")
    if a.json:
        a.json.write_text(json.dumps({"rounds_off": rounds[False], "rounds_on": rounds[True],
                                      "ratio_decode": ratio_e, "ratio_wall": ratio_w, "load_before": load_before,
                                      "load_after": load_after, "browser": a.browser}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
