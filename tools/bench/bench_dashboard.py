"""What the node's page costs the node's decoding (issue 58: with the page open and updating, decode tokens/s
÷ without it ≥ 0.98).

Starts `provider start --local` (the bundled model unless --model) and compares decoding with the page open and
without it, alternated in one run, two ways:

- rounds: the same greedy job (max_tokens --tokens) again and again, rounds without the page and with it in ABBA
  order, each job's decode tokens/s from its own telemetry (and by the wall clock);
- windows: one long greedy job after another while the page is switched on and off every --window seconds, the
  tokens decoded in each window read from the engine's live step count (/health `queue.batch_rows`, read at
  every switch in both conditions alike); windows a job ended in are dropped. Adjacent windows pair up, so a
  drift of the machine's other load falls on both sides of a pair.

"The page open" is what an open page does to the node: a client polling GET /ui/state once a second with the
page's session cookie, from a thread of this process (`--browser`: a real headless chromium showing the page,
whose own rendering then also shares the machine's cores with the node, as on an operator's laptop). Prints the
ratios on/off (target >= 0.98) and the load average before and after.

    python -m tools.bench.bench_dashboard [--model DIR] [--pairs 8] [--windows 30] [--browser]
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


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def windows(server, switch, a) -> tuple[list[float], list[float], list[float]]:
    """Tokens/s per window with the page off and on, and each adjacent pair's ratio on/off."""
    stop = threading.Event()

    def jobs() -> None:
        while not stop.is_set():
            one_job(server, a.window_tokens, a.speculation)

    worker = threading.Thread(target=jobs, daemon=True)
    worker.start()
    time.sleep(a.window)  # the first job under way
    rates: dict[bool, list[float]] = {False: [], True: []}
    pairs, pending = [], {}
    for i in range(2 * a.windows):
        on = (i % 2 == 0) == ((i // 2) % 2 == 1)  # ABBA: off on, on off, ...
        switch(on)
        h0, t0 = health(server), time.perf_counter()
        time.sleep(a.window)
        h1, t1 = health(server), time.perf_counter()
        ended = h1["counters"]["jobs_completed"] != h0["counters"]["jobs_completed"]
        if ended or h0["active_jobs"] != 1 or h1["active_jobs"] != 1:
            pending.clear()
            continue  # a job ended (or none ran) in the window: its steps are not one stream's
        rate = (h1["queue"]["batch_rows"] - h0["queue"]["batch_rows"]) / (t1 - t0)
        rates[on].append(rate)
        pending[on] = rate
        if i % 2 == 1 and len(pending) == 2:
            pairs.append(pending[True] / pending[False])
        if i % 2 == 1:
            pending.clear()
        print(f"window {i + 1:3d} page {'on ' if on else 'off'}: {rate:8.2f} tokens/s", flush=True)
    switch(False)
    stop.set()
    worker.join()
    return rates[False], rates[True], pairs


def poll_cost(server, page: Poller, n: int = 300) -> dict:
    """The node's own CPU time for one /ui/state (and, beside it, one /health) with the node idle: what an open page
    takes from it per second, whatever else the machine runs (CPU time, not wall time)."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    out = {}
    for name, call in (("ui_state", lambda: page.client.get(f"{server.url}/ui/state", params={"since": page.seq},
                                                             headers={"Sec-Fetch-Site": "same-origin"})),
                       ("health", lambda: page.client.get(f"{server.url}/health"))):
        call()
        before = proc.cpu_times()
        for _ in range(n):
            call().raise_for_status()
        after = proc.cpu_times()
        out[name] = (after.user + after.system - before.user - before.system) / n
    return out


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):8.2f}  mean {statistics.fmean(values):8.2f}  " \
           f"min {min(values):8.2f}  max {max(values):8.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    ap.add_argument("--mode", choices=["rounds", "windows", "both"], default="both")
    ap.add_argument("--pairs", type=int, default=8, help="rounds: jobs of each condition (default 8)")
    ap.add_argument("--tokens", type=int, default=192, help="rounds: max_tokens of each job (default 192)")
    ap.add_argument("--windows", type=int, default=30, help="windows: pairs of windows (default 30)")
    ap.add_argument("--window", type=float, default=2.0, help="windows: seconds each (default 2)")
    ap.add_argument("--window-tokens", type=int, default=1500, help="windows: max_tokens of each job (default 1500)")
    ap.add_argument("--speculation", choices=["off", "auto", "on"], default="off",
                    help="the jobs' speculation (default off: plain decoding, one token a step)")
    ap.add_argument("--settle", type=float, default=2.0, help="rounds: seconds between switching and the job")
    ap.add_argument("--browser", action="store_true", help="a real headless chromium showing the page")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    if a.browser and harness.available():
        print(f"bench_dashboard: {harness.available()}", file=sys.stderr)
        return 1
    if a.mode != "rounds" and a.speculation != "off":
        print("bench_dashboard: windows count one token a step: --speculation off (or --mode rounds)",
              file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    out: dict = {"browser": a.browser, "load_before": load_before}
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
            if a.mode in ("rounds", "both"):
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
                out["rounds"] = rounds
            if a.mode in ("windows", "both"):
                out["windows"] = windows(server, switch, a)
            if not a.browser:
                time.sleep(1.0)
                out["cost"] = poll_cost(server, page)
        finally:
            if page is not None and a.browser:
                page.browser.quit()
            server.stop()
    out["load_after"] = load_after = os.getloadavg()
    how = "a headless chromium showing the page" if a.browser else "a client polling /ui/state every second"
    print(f"\npage open = {how}; speculation {a.speculation}")
    if "rounds" in out:
        r = out["rounds"]
        off_e, on_e = [x[0] for x in r[False]], [x[0] for x in r[True]]
        off_w, on_w = [x[1] for x in r[False]], [x[1] for x in r[True]]
        print(f"rounds: {a.pairs} jobs each, ABBA, max_tokens {a.tokens}")
        print(f"  decode tokens/s (engine)  page off: {summary(off_e)}")
        print(f"  decode tokens/s (engine)  page on:  {summary(on_e)}")
        print(f"  tokens/s (wall clock)     page off: {summary(off_w)}")
        print(f"  tokens/s (wall clock)     page on:  {summary(on_w)}")
        out["rounds_ratio"] = statistics.median(on_e) / statistics.median(off_e)
        print(f"  ratio on/off of the medians: decode {out['rounds_ratio']:.4f}, wall "
              f"{statistics.median(on_w) / statistics.median(off_w):.4f} (means: "
              f"{statistics.fmean(on_e) / statistics.fmean(off_e):.4f}, "
              f"{statistics.fmean(on_w) / statistics.fmean(off_w):.4f})")
    if "windows" in out:
        off, on, pairs = out["windows"]
        print(f"windows: {a.window:g} s each, {len(off)} off and {len(on)} on kept, {len(pairs)} adjacent pairs")
        print(f"  decode tokens/s  page off: {summary(off)}")
        print(f"  decode tokens/s  page on:  {summary(on)}")
        out["windows_ratio"] = statistics.median(pairs)
        print(f"  ratio on/off: median of the pairs {out['windows_ratio']:.4f}, of the means "
              f"{statistics.fmean(on) / statistics.fmean(off):.4f}, of the medians "
              f"{statistics.median(on) / statistics.median(off):.4f}")
    if "cost" in out:
        c = out["cost"]
        print(f"the node's CPU time per poll (idle node, {300} polls): /ui/state {c['ui_state'] * 1000:.2f} ms, "
              f"/health {c['health'] * 1000:.2f} ms; at one poll a second the page takes "
              f"{c['ui_state'] * 100:.2f} % of one core, so decoding keeps >= {1 - c['ui_state']:.4f} of its rate "
              "even if every poll stalled the engine for all of its CPU time")
    print("target: ratio >= 0.98")
    if not a.browser and page is not None and page.latencies:
        lat = sorted(page.latencies)
        print(f"/ui/state: {page.polls} polls, latency p50 {lat[len(lat) // 2] * 1000:.2f} ms, "
              f"max {lat[-1] * 1000:.2f} ms")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cores)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
