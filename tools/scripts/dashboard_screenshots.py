"""Screenshots of the node's page at desktop (1280x800) and phone (390x844) widths, in the same headless chromium the
tests drive (tools/harness/browser.py), for docs/operations.md.

Starts `provider start --local` (the bundled model unless --model), sends it traffic for a while so the last hour's
charts have points (repeated prompts for prefix hits, greedy requests, every other one speculating whatever auto would say), asks one question in the
page's chat box, then takes both full-page screenshots.

    python -m tools.scripts.dashboard_screenshots [--model DIR] [--seconds 75] [--out docs/img]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tools.harness import browser as harness
from tools.harness.daemon import LocalServer

PROMPTS = ["Write a haiku about the sea.", "List three uses of copper.", "What is a prime number?",
           "Explain a hash table in two sentences.", "Name the planets of the solar system."]
SYSTEM = "You are a terse assistant. " * 40  # a long shared prefix: the prefix cache serves it after the first


def traffic(url: str, headers: dict, stop: threading.Event, streams: int = 2) -> None:
    def one(i: int) -> None:
        for n in itertools.count(i):
            if stop.is_set():
                return
            try:
                httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                    "max_tokens": 48, "temperature": 0, "speculation": "on" if n % 2 else "auto"})
            except httpx.HTTPError:
                time.sleep(0.5)
            stop.wait(0.5)

    for i in range(streams):
        threading.Thread(target=one, args=(i,), daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    ap.add_argument("--seconds", type=float, default=75.0, help="traffic before the screenshots (default 75)")
    ap.add_argument("--out", type=Path, default=Path("docs/img"), help="where the PNGs go (default docs/img)")
    args = ap.parse_args()
    why = harness.available()
    if why:
        print(f"dashboard_screenshots: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="provider-shots-") as home:
        server = LocalServer(args.model, Path(home))
        stop = threading.Event()
        try:
            link = harness.login_link(server)
            traffic(server.url, server.headers, stop)
            with harness.Browser(harness.DESKTOP) as b:
                b.get(link)
                b.wait(lambda: (b.field("link") or "").startswith("live"), "live figures", 30)
                time.sleep(args.seconds)
                stop.set()
                b.driver.find_element("id", "chat-max").clear()
                b.driver.find_element("id", "chat-max").send_keys("40")
                box = b.driver.find_element("id", "chat-input")
                box.send_keys("In one sentence: what does this node do?")
                box.send_keys("\n")
                b.wait(lambda: b.field("chat-telemetry"), "the chat answer", 120)
                b.js("document.activeElement.blur()")
                time.sleep(6)  # the last sample after the traffic stopped, and a quiet link line
                desktop = b.screenshot(args.out / "dashboard-desktop.png")
                b.resize(*harness.PHONE, mobile=True)
                time.sleep(1.5)
                phone = b.screenshot(args.out / "dashboard-phone.png")
                problems = b.console_errors()
        finally:
            stop.set()
            server.stop()
    print(f"wrote {desktop} and {phone}")
    if problems:
        print("the page logged errors:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
