"""The engine's books: what MLX really holds vs the node's memory ledger, under a KV-heavy mixed load.

Builds a small Llama with heavy KV per token (4 layers, 8 KV heads x head_dim 32, fp32, context 4096) with the
fixture factory, serves it with the node daemon (prefix cache on, a generous budget), and samples /health every
50 ms while three phases run, each followed by an idle period once every job has ended:

- a: 8 distinct ~800-token prompts at once;
- b: one ~1,500-token prompt sent while 15 short prompts decode;
- c: 30 jobs of random prompt and output lengths, a third of whose clients hang up after a few chunks.

For each phase it prints the sample with the most MLX memory active (`memory.mlx_active_bytes`) beside the ledger
at that sample (`memory.reserved_bytes` = models + jobs' KV + prefix caches, with its parts), the same at idle,
and a verdict for the target: active <= ledger x 1.10 + 16 MiB at every sample. End-of-sequence tokens are
biased away (logit_bias -100) so every job runs to its max_tokens. The exit code is 0 whatever the verdict.

    python tools/bench/memory_ledger.py [--seed N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models import fixtures  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

MiB = 2**20
PHASE_TIMEOUT = 240.0  # seconds for a phase's jobs; its idle period has its own bound below
IDLE_TIMEOUT, IDLE_SAMPLE = 30.0, 2.0  # wait at most this for every job to end, then sample this long
WORDS = fixtures.CORPUS.split()


def build_model(out: Path) -> tuple[Path, list[int]]:
    """The fixture factory's KV-heavy Llama (8 KiB of fp32 KV per token), and its end-of-sequence ids."""
    fixtures.make_llama_kv_heavy(out)
    config = json.loads((out / "config.json").read_text())
    return out, list(config["eos_token_id"])


class Sampler(threading.Thread):
    """GET /health every 50 ms; each sample is tagged with the phase running when it was taken."""

    def __init__(self, srv: LocalServer):
        super().__init__(daemon=True)
        self.srv, self.label, self.samples, self.stopping = srv, "start", [], threading.Event()

    def run(self) -> None:
        with httpx.Client(headers=self.srv.headers, timeout=5) as c:
            while not self.stopping.is_set():
                t = time.perf_counter()
                try:
                    h = c.get(self.srv.url + "/health").json()
                    self.samples.append({"t": t, "phase": self.label, "memory": h.get("memory", {}),
                                         "busy": h.get("active_jobs", 0) + h.get("queued_jobs", 0)})
                except (httpx.HTTPError, ValueError):
                    pass
                self.stopping.wait(max(0.0, 0.05 - (time.perf_counter() - t)))

    def latest(self) -> dict:
        return self.samples[-1] if self.samples else {"busy": 1}


class Load:
    """Completion requests on threads, with their outcome counted."""

    def __init__(self, srv: LocalServer, tok, no_eos: list[int]):
        self.srv, self.tok, self.bias = srv, tok, {str(i): -100 for i in no_eos}
        self.threads: list[threading.Thread] = []
        self.ok = self.failed = self.dropped = self.tokens = 0
        self.lock = threading.Lock()

    def prompt(self, n_tokens: int, rng: random.Random) -> str:
        """About `n_tokens` tokens of corpus words in a random order (distinct prompts from the first token)."""
        words = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
        return self.tok.decode(self.tok.encode(words, add_special_tokens=False).ids[:n_tokens])

    def start(self, prompt: str, max_tokens: int, drop_after: int = 0, first: threading.Event | None = None):
        t = threading.Thread(target=self._run, args=(prompt, max_tokens, drop_after, first), daemon=True)
        t.start()
        self.threads.append(t)

    def _run(self, prompt: str, max_tokens: int, drop_after: int, first: threading.Event | None) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
                "logit_bias": self.bias, "stream_options": {"include_usage": True}}
        chunks, outcome = 0, "failed"
        try:
            with httpx.stream("POST", self.srv.url + "/v1/completions", json=body, headers=self.srv.headers,
                              timeout=PHASE_TIMEOUT) as r:
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if line == "data: [DONE]":
                        outcome = "ok"
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            with self.lock:
                                self.tokens += chunk["usage"]["completion_tokens"]
                        if chunk.get("choices"):
                            chunks += 1
                            if first is not None:
                                first.set()
                        if drop_after and chunks >= drop_after:
                            outcome = "dropped"
                            break  # leaving the block closes the connection mid-stream
        except httpx.HTTPError:
            pass
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    def join(self, deadline: float) -> bool:
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


def phase_a(load: Load, rng: random.Random) -> None:
    for _ in range(8):
        load.start(load.prompt(800, rng), 64)


def phase_b(load: Load, rng: random.Random) -> None:
    firsts = [threading.Event() for _ in range(15)]
    for ev in firsts:
        load.start(load.prompt(rng.randint(16, 48), rng), 256, first=ev)
    for ev in firsts:  # all 15 decoding before the long prompt arrives
        ev.wait(60)
    load.start(load.prompt(1500, rng), 16)


def phase_c(load: Load, rng: random.Random) -> None:
    drops = set(rng.sample(range(30), 10))
    for i in range(30):
        load.start(load.prompt(rng.randint(16, 1200), rng), rng.randint(16, 256),
                   drop_after=rng.randint(2, 6) if i in drops else 0)
        time.sleep(rng.uniform(0, 0.1))


PHASES = [("a", "8 x ~800-token prompts at once", phase_a),
          ("b", "one ~1,500-token prompt beside 15 short decoding", phase_b),
          ("c", "30 random jobs, 10 clients drop mid-stream", phase_c)]


def bound(m: dict) -> float:
    return m["reserved_bytes"] * 1.10 + 16 * MiB


def describe(tag: str, samples: list[dict]) -> str:
    if not samples:
        return f"  {tag:5} no samples"
    m = max(samples, key=lambda s: s["memory"]["mlx_active_bytes"])["memory"]
    active, ledger = m["mlx_active_bytes"], m["reserved_bytes"]
    return (f"  {tag:5} MLX active {active / MiB:8.1f} MiB   ledger {ledger / MiB:8.1f} MiB (models "
            f"{m.get('models_bytes', 0) / MiB:.1f}, jobs' KV {m.get('jobs_kv_bytes', 0) / MiB:.1f}, prefix cache "
            f"{m.get('prefix_cache_bytes', 0) / MiB:.1f})   active/ledger {active / max(ledger, 1):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write every /health sample and the verdicts as JSON")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    from tokenizers import Tokenizer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model, no_eos = build_model(Path(tmp) / "llama-kv-heavy")
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        env = {"PROVIDER_MEMORY_BUDGET_GB": "12", "PROVIDER_PREFIX_CACHE_GB": "1", "PROVIDER_SPECULATION": "off",
               "PROVIDER_MAX_CONCURRENT_JOBS": "32"}
        (home := Path(tmp) / "home").mkdir()
        srv = LocalServer(model, home, env=env)
        threading.Thread(target=lambda: [None for _ in srv.proc.stdout], daemon=True).start()  # keep stdout drained
        sampler = Sampler(srv)
        try:
            warm = Load(srv, tok, no_eos)
            warm.start("The provider node serves", 4)
            warm.join(time.monotonic() + 120)
            sampler.start()
            time.sleep(0.5)
            base = sampler.latest().get("memory", {})
            missing = [k for k in ("mlx_active_bytes", "reserved_bytes", "models_bytes", "jobs_kv_bytes",
                                   "prefix_cache_bytes") if k not in base]
            print(f"model {model.name}: 4 layers, 8 KV heads x 32, fp32 (8 KiB KV/token); /health every 50 ms")
            if missing:
                print(f"  /health memory lacks: {', '.join(missing)}")
            print(describe("start", sampler.samples))
            for name, title, run in PHASES:
                load = Load(srv, tok, no_eos)
                started = time.monotonic()
                sampler.label = name
                run(load, rng)
                finished = load.join(started + PHASE_TIMEOUT)
                seconds = time.monotonic() - started
                sampler.label = name + " idle"
                deadline = time.monotonic() + IDLE_TIMEOUT
                while sampler.latest()["busy"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                drained = not sampler.latest()["busy"]
                sampler.label = name + " rest"  # every job has ended: this is the idle figure
                time.sleep(IDLE_SAMPLE)
                busy = [s for s in sampler.samples if s["phase"] in (name, name + " idle")]
                rest = [s for s in sampler.samples if s["phase"] == name + " rest"]
                over = [s for s in busy + rest if s["memory"]["mlx_active_bytes"] > bound(s["memory"])]
                worst = max((s["memory"]["mlx_active_bytes"] - bound(s["memory"]) for s in busy + rest), default=0)
                verdict = "PASS" if not over and finished and drained else "FAIL"
                print(f"phase {name}: {title}: {seconds:.1f} s, jobs {load.ok} ok, {load.dropped} dropped, "
                      f"{load.failed} failed, {load.tokens} tokens{'' if finished else ', TIMED OUT'}"
                      f"{'' if drained else ', jobs still running at idle'}")
                print(describe("peak", busy))
                print(describe("idle", rest))
                print(f"  verdict {verdict}: {len(over)} of {len(busy) + len(rest)} samples over ledger x 1.10 + "
                      f"16 MiB (worst by {worst / MiB:+.1f} MiB)", flush=True)
                results.append({"phase": name, "title": title, "verdict": verdict, "seconds": seconds,
                                "ok": load.ok, "dropped": load.dropped, "failed": load.failed,
                                "samples_over": len(over), "samples": len(busy) + len(rest)})
        finally:
            sampler.stopping.set()
            srv.stop()
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "phases": results, "samples": sampler.samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
