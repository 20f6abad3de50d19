"""The engine's books: what MLX really holds vs the node's memory ledger, under a KV-heavy mixed load.

Builds a small Llama with heavy KV per token (4 layers, 8 KV heads x head_dim 32, fp32, context 4096) with the
fixture factory, serves it with the node daemon (prefix cache on, a generous budget), and samples /health every
50 ms while three phases run, each followed by an idle period once every job has ended:

- a: 8 distinct ~800-token prompts at once;
- b: one ~1,500-token prompt sent while 15 short prompts decode;
- c: 30 jobs of random prompt and output lengths, a third of whose clients hang up after a few chunks;

then, on a second node serving the fixture factory's Gemma 4 VLM (a 280-token default image budget, as real
Gemma 4 checkpoints have; detail high is 1,120):

- d: images, all at once: two jobs of one high-detail photo each, two of four photos at the default detail, one
  of 16 one-pixel PNGs at detail low, and two text jobs beside them;

then, on a third node serving the same KV-heavy Llama with a 32k context:

- e: agents at agent scale: two agents at once, one on /v1/messages (Anthropic's shape, `system` and `tools`
  with input schemas) and one on /v1/responses (`instructions` and function tools), each resending its own
  ~10k-token system prompt and tool list for three turns, each turn appending the previous answer and a new
  user message, so the prefix cache holds and reuses long prefixes. Per turn it prints the prompt's tokens
  and how many came from the prefix cache (usage's cache_read_input_tokens / input_tokens_details.cached_tokens).
  ~10k, not the 20k agents send: MLX's CPU attention reads a 20.6k-token prompt of this model in 284 s (its
  next turn, from the cache, in 1 s), quadratic in the length; 10k keeps the phase to a few minutes;

then, on a fourth node serving the KV-heavy Llama (4k context) with its KV quantized (kv_bits 4, groups of 32:
its heads are 32 wide), the ledger booking each row at the quantized size:

- q: quantized KV: phase a's 8 ~800-token prompts at once, and phase b's 15 short decoding with a ~1,500-token
  prompt joining them (rows joining and leaving a quantized batch, its prefix cache keeping quantized rows).

then, on a fifth node serving a hybrid Qwen3.5 (Gated DeltaNet and full attention, fp32) that carries its own MTP
head, with speculation on (k = 3), the ledger booking the head's weights and activations beside the target and each
row's head K/V:

- m: speculating with the target's own head: 8 ~200-token prompts at once, then 8 short decoding with a
  ~600-token prompt joining them (every job drafted and verified in the speculating batch); it prints the
  node's drafted, accepted and target forward counters to show the rounds ran. `--m-speculation off` runs the
  same phase plain, to tell the head's part from the hybrid target's. (MLX's CPU build steps the Gated DeltaNet
  one position at a time: this model reads ~10 prompt tokens a second here, so the phase is kept small.)

then, on a sixth node serving a Qwen3 (4 layers, 8 KV heads x 32, fp32) with an untrained DFlash drafter
(`--drafter`), speculation as phase m's, the ledger booking the drafter's tensors, its activations and each row's
context K/V (2 layers x K,V x 8 x 32: 4 KiB a committed token):

- f: a drafter with a KV of its own: 16 ~500-token prompts at once, then phase m's load.

then, on a seventh node serving a Muse Glimmer (4 layers, 16 KV heads x 64, fp32) with an untrained MuseGlimmer
assistant of window 128, the ledger booking its context K/V as a sliding-window layer's (at most the window a row):

- w: a windowed drafter: phase f's load, its ~500-token prompts four times the window.

For each phase it prints the sample with the most MLX memory active (`memory.mlx_active_bytes`) beside the ledger
at that sample (`memory.reserved_bytes` = models + jobs' KV + prefix caches, with its parts), the same at idle,
and a verdict for the target: active <= ledger x 1.10 + 16 MiB at every sample. Images are decoded and prepared
into numpy arrays, which MLX does not count, so phase d is judged on the node process's RSS as well: RSS beyond
what the process holds outside the ledger at rest (interpreter, libraries, tokenizers: RSS - ledger, measured
after a warm-up image) stays within ledger x 1.10 + 64 MiB at every sample. End-of-sequence tokens are
biased away (logit_bias -100) so every job runs to its max_tokens (not in phase e: neither agent API takes a
logit_bias). Phase e is judged as a-c. The exit code is 0 whatever the verdict.

    python tools/bench/memory_ledger.py [--seed N] [--out FILE] [--phases abcdeqmfw] [--m-speculation on|off]
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
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures import factory  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

MiB = 2**20
RSS_SLACK = 64 * MiB  # phase d's RSS target: ledger x 1.10 + this
PHASE_TIMEOUT = 600.0  # seconds for a phase's jobs; its idle period has its own bound below
IDLE_TIMEOUT, IDLE_SAMPLE = 30.0, 2.0  # wait at most this for every job to end, then sample this long
WORDS = factory.CORPUS.split()
# Phase e: an agent's prompt (a system prompt of AGENT_SYSTEM tokens and AGENT_TOOLS tools of AGENT_TOOL tokens of text,
# ~440 tokens each as the generic tool preamble renders them: ~10k tokens in all), on a model with this context.
AGENT_CONTEXT = 32768
AGENT_SYSTEM, AGENT_TOOLS, AGENT_TOOL = 4000, 14, 220
AGENT_ASK, AGENT_ANSWER = 120, 32  # tokens of each new user message; max tokens of each answer
AGENT_TURNS = 3


def build_model(out: Path, context: int = 4096) -> tuple[Path, list[int]]:
    """The fixture factory's KV-heavy Llama (8 KiB of fp32 KV per token) with a `context`-token window (its
    rotary embedding is unscaled, so the window is the config's bound alone), and its end-of-sequence ids."""
    factory.make_llama_kv_heavy(out)
    config = json.loads((out / "config.json").read_text())
    if config["max_position_embeddings"] != context:
        (out / "config.json").write_text(json.dumps(config | {"max_position_embeddings": context}, indent=2))
    return out, list(config["eos_token_id"])


class Sampler(threading.Thread):
    """GET /health every 50 ms; each sample is tagged with the phase running when it was taken."""

    def __init__(self, srv: LocalServer):
        super().__init__(daemon=True)
        self.srv, self.label, self.samples, self.stopping = srv, "start", [], threading.Event()
        self.proc = psutil.Process(srv.proc.pid)

    def run(self) -> None:
        with httpx.Client(headers=self.srv.headers, timeout=5) as c:
            while not self.stopping.is_set():
                t = time.perf_counter()
                try:
                    rss = self.proc.memory_info().rss  # before and after the ledger: the larger ledger of the two
                    h = c.get(self.srv.url + "/health").json()
                    rss = max(rss, self.proc.memory_info().rss)
                    self.samples.append({"t": t, "phase": self.label, "memory": h.get("memory", {}), "rss": rss,
                                         "busy": h.get("active_jobs", 0) + h.get("queued_jobs", 0),
                                         "counters": h.get("counters", {})})
                except (httpx.HTTPError, ValueError, psutil.Error):
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
        self.errors: list[str] = []  # the first words of each refusal
        self.turns: list[dict] = []  # phase e: each agent turn's prompt tokens, cached tokens and seconds
        self.lock = threading.Lock()

    def prompt(self, n_tokens: int, rng: random.Random) -> str:
        """About `n_tokens` tokens of corpus words in a random order (distinct prompts from the first token)."""
        words = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
        return self.tok.decode(self.tok.encode(words, add_special_tokens=False).ids[:n_tokens])

    def start(self, prompt: str, max_tokens: int, drop_after: int = 0, first: threading.Event | None = None):
        t = threading.Thread(target=self._run, args=(prompt, max_tokens, drop_after, first), daemon=True)
        t.start()
        self.threads.append(t)

    def chat(self, content: list[dict], max_tokens: int) -> None:
        """A chat request whose user turn is `content` (text and image parts)."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 1.0,
                "stream": True, "logit_bias": self.bias, "stream_options": {"include_usage": True}}
        t = threading.Thread(target=self._run, args=(body, 0, 0, None, "/v1/chat/completions"), daemon=True)
        t.start()
        self.threads.append(t)

    def _run(self, prompt: str | dict, max_tokens: int, drop_after: int, first: threading.Event | None,
             path: str = "/v1/completions") -> None:
        body = prompt if isinstance(prompt, dict) else {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": True, "logit_bias": self.bias,
            "stream_options": {"include_usage": True}}
        chunks, outcome = 0, "failed"
        try:
            with httpx.stream("POST", self.srv.url + path, json=body, headers=self.srv.headers,
                              timeout=PHASE_TIMEOUT) as r:
                if r.status_code != 200:
                    with self.lock:
                        self.errors.append(f"{r.status_code} {r.read()[:200]!r}")
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

    def agent(self, api: str, system: str, tools: list[dict], asks: list[str]) -> None:
        """An agent on `api` (messages | responses): `asks` as successive turns, the whole conversation resent
        each time behind the same system prompt and tools."""
        t = threading.Thread(target=self._agent, args=(api, system, tools, asks), daemon=True)
        t.start()
        self.threads.append(t)

    def _agent(self, api: str, system: str, tools: list[dict], asks: list[str]) -> None:
        history: list[dict] = []
        headers = self.srv.headers | ({"anthropic-version": "2023-06-01"} if api == "messages" else {})
        for turn, ask in enumerate(asks, 1):
            history.append({"role": "user", "content": ask})
            if api == "messages":
                body = {"system": system, "messages": history, "tools": tools, "max_tokens": AGENT_ANSWER,
                        "temperature": 1.0}
            else:
                body = {"instructions": system, "input": history, "tools": tools, "store": False,
                        "max_output_tokens": AGENT_ANSWER, "temperature": 1.0}
            started = time.perf_counter()
            try:
                r = httpx.post(f"{self.srv.url}/v1/{api}", json=body, headers=headers, timeout=PHASE_TIMEOUT)
                out = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                r, out = None, None
            if out is None:
                with self.lock:
                    self.failed += 1
                    if r is not None:
                        self.errors.append(f"{r.status_code} {r.content[:200]!r}")
                return
            seconds = time.perf_counter() - started
            u = out["usage"]
            if api == "messages":
                cached, answered = u["cache_read_input_tokens"], u["output_tokens"]
                prompt = u["input_tokens"] + cached
                history += messages_reply(out["content"])
            else:
                prompt, cached, answered = u["input_tokens"], u["input_tokens_details"]["cached_tokens"], \
                    u["output_tokens"]
                history += responses_reply(out["output"])
            with self.lock:
                self.ok += 1
                self.tokens += answered
                self.turns.append({"agent": api, "turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
                                   "seconds": seconds})

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


def image_part(seed: int, size: tuple[int, int], detail: str, fmt: str = "JPEG") -> dict:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def phase_d(load: Load, rng: random.Random) -> None:
    ask = {"type": "text", "text": "Describe these pictures."}
    for i in range(2):
        load.chat([image_part(rng.randrange(1 << 30), (640, 480), "high"), ask], 16)
    for i in range(2):
        load.chat([image_part(rng.randrange(1 << 30), (rng.randint(200, 900), rng.randint(200, 900)), "auto")
                   for _ in range(4)] + [ask], 16)
    load.chat([image_part(rng.randrange(1 << 30), (1, 1), "low", "PNG") for _ in range(16)] + [ask], 16)
    for i in range(2):
        load.chat([{"type": "text", "text": load.prompt(200, rng)}], 48)


def messages_reply(content: list[dict]) -> list[dict]:
    """What an agent appends after an Anthropic answer: the answer, and a result for each tool it called."""
    blocks = [b for b in content if b["type"] == "tool_use" or b.get("text")]
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "done"}
               for b in blocks if b["type"] == "tool_use"]
    return [{"role": "assistant", "content": blocks or "..."}] + ([{"role": "user", "content": results}]
                                                                   if results else [])


def responses_reply(output: list[dict]) -> list[dict]:
    """What an agent appends after a Responses answer: its message and calls, and each call's output."""
    items: list[dict] = []
    for o in output:
        if o["type"] == "message":
            text = "".join(p.get("text", "") for p in o["content"])
            items.append({"role": "assistant", "content": text or "..."})
        elif o["type"] == "function_call":
            items.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
            items.append({"type": "function_call_output", "call_id": o["call_id"], "output": "done"})
    return items


def agent_tools(load: Load, rng: random.Random, api: str) -> list[dict]:
    """AGENT_TOOLS tools as an agent declares them: a long description and a few described arguments."""
    tools = []
    for i in range(AGENT_TOOLS):
        args = {f"arg_{j}": {"type": "string", "description": load.prompt(AGENT_TOOL // 8, rng)} for j in range(3)}
        schema = {"type": "object", "properties": args, "required": ["arg_0"]}
        about = load.prompt(AGENT_TOOL * 5 // 8, rng)
        tools.append({"name": f"tool_{i}", "description": about, "input_schema": schema} if api == "messages" else
                     {"type": "function", "name": f"tool_{i}", "description": about, "parameters": schema})
    return tools


def phase_e(load: Load, rng: random.Random) -> None:
    for api in ("messages", "responses"):  # two agents at once, each with its own prompt
        system, tools = load.prompt(AGENT_SYSTEM, rng), agent_tools(load, rng, api)
        load.agent(api, system, tools, [load.prompt(AGENT_ASK, rng) for _ in range(AGENT_TURNS)])


def phase_q(load: Load, rng: random.Random) -> None:
    phase_a(load, rng)
    phase_b(load, rng)


def phase_m(load: Load, rng: random.Random) -> None:
    for _ in range(8):
        load.start(load.prompt(200, rng), 32)
    load.join(time.monotonic() + PHASE_TIMEOUT)
    firsts = [threading.Event() for _ in range(8)]
    for ev in firsts:
        load.start(load.prompt(rng.randint(16, 48), rng), 64, first=ev)
    for ev in firsts:
        ev.wait(120)
    load.start(load.prompt(600, rng), 16)


def phase_f(load: Load, rng: random.Random) -> None:
    for _ in range(16):
        load.start(load.prompt(500, rng), 48)
    load.join(time.monotonic() + PHASE_TIMEOUT)
    phase_m(load, rng)


def print_turns(turns: list[dict]) -> None:
    print("  agent      turn   prompt   cached  from cache  seconds")
    for t in sorted(turns, key=lambda t: (t["agent"], t["turn"])):
        print(f"  {t['agent']:10} {t['turn']:4} {t['prompt_tokens']:8} {t['cached_tokens']:8} "
              f"{t['cached_tokens'] / max(t['prompt_tokens'], 1):10.1%} {t['seconds']:8.1f}")


TEXT_PHASES = [("a", "8 x ~800-token prompts at once", phase_a),
               ("b", "one ~1,500-token prompt beside 15 short decoding", phase_b),
               ("c", "30 random jobs, 10 clients drop mid-stream", phase_c)]
IMAGE_PHASES = [("d", "images: 2 x 1 high-detail, 2 x 4 default, 1 x 16 tiny at low, 2 text jobs", phase_d)]
AGENT_PHASES = [("e", f"2 agents at once (messages, responses), {AGENT_TURNS} turns each of a ~10k-token prompt",
                 phase_e)]
SPEC_PHASES = [("m", ("its own MTP head: 8 x ~200-token prompts, then 8 short decoding and a ~600-token prompt "
                      "joining"), phase_m)]
DFLASH_PHASES = [("f", "a DFlash drafter (its own context K/V a row): 16 x ~500-token prompts, then phase m's load",
                   phase_f)]
WINDOWED_PHASES = [("w", "a windowed drafter (its context K/V: the last 128 positions a row): phase f's load",
                    phase_f)]
QUANT_PHASES = [("q", "kv_bits 4: 8 x ~800-token prompts, 15 short decoding and a ~1,500-token prompt joining",
                 phase_q)]


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


def build_vlm(out: Path) -> tuple[Path, list[int]]:
    """The fixture factory's Gemma 4 VLM with a 280-token default image budget, and its end-of-sequence ids."""
    from tools.fixtures.vision import make_gemma4_vlm

    make_gemma4_vlm(out, soft_tokens=280)
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    return out, list(eos) if isinstance(eos, list) else [eos]


def build_hybrid(out: Path) -> tuple[Path, list[int]]:
    """The fixture factory's Qwen3.5 with its MTP head, at a size where the books show: 8 layers, 6 of them Gated
    DeltaNet with 256 KiB of recurrent state each per row, 2 of full attention (4 KiB of KV per token), a 4k
    context; its head untrained (memory does not depend on what it drafts). No end-of-sequence bias: a logit bias
    would keep a job off the speculating path."""
    from tools.fixtures.mtp import make_qwen3_5_mtp_tiny

    make_qwen3_5_mtp_tiny(out, train=False, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                          full_attention_interval=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          linear_num_value_heads=16, linear_num_key_heads=4, linear_key_head_dim=64,
                          linear_value_head_dim=64, max_position_embeddings=4096,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                           "mrope_section": [4, 2, 2]})
    return out, []


def build_dflash(out: Path) -> tuple[Path, Path]:
    """The fixture factory's Qwen3 at a size where the books show (4 layers, 8 KV heads x 32, fp32: 8 KiB of KV
    a token, a 4k context) and an untrained 2-layer DFlash drafter on it, whose context K/V per committed token
    is 4 KiB (memory does not depend on what it drafts). Returns the target and the drafter."""
    from tools.fixtures.factory import make_qwen3_tiny
    from tools.fixtures.dflash import drafter_dir, write_drafter

    make_qwen3_tiny(out, num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=16,
                    num_key_value_heads=16, head_dim=64, max_position_embeddings=4096)
    write_drafter(out, drafter_dir(out), json.loads((out / "config.json").read_text()), seed=0, train=False)
    return out, drafter_dir(out)


def build_windowed(out: Path) -> tuple[Path, Path]:
    """The fixture factory's Muse Glimmer at phase f's size (2 layers, 16 KV heads x 64, fp32) and an untrained
    2-layer MuseGlimmer assistant of window 128 on it: 16 KiB of context K/V a committed token, at most 2 MiB a row
    however long its prompt (its cache keeps the window). Returns the target and the drafter."""
    from provider.drafters.dflash.head import DFlashHead
    from tools.fixtures.dflash import build_beside, drafter_dir
    from tools.fixtures.muse_glimmer import assistant_config, make_muse_glimmer_tiny, muse_names

    sizes = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 16,
             "num_key_value_heads": 16, "head_dim": 64, "max_position_embeddings": 4096}
    build_beside(out, lambda d: make_muse_glimmer_tiny(d, **sizes), lambda t: assistant_config(t) | {
        "sliding_window": 128}, DFlashHead, seed=0, train=False, saved=muse_names)
    return out, drafter_dir(out)


def rss_bound(s: dict, outside: float) -> float:
    return s["memory"]["reserved_bytes"] * 1.10 + RSS_SLACK + outside


def serve(model: Path, no_eos: list[int], home: Path, phases: list, rng: random.Random, warm: list[dict] | None,
          results: list[dict], samples: list[dict], kv_bits: int = 0, speculation: str = "off",
          extra: tuple[str, ...] = ()) -> None:
    """One node on `model`, warmed up, then each phase and its idle period, with their verdicts printed."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    env = {"PROVIDER_MEMORY_BUDGET_GB": "12", "PROVIDER_PREFIX_CACHE_GB": "1", "PROVIDER_SPECULATION": speculation,
           "PROVIDER_MAX_CONCURRENT_JOBS": "32", "PROVIDER_KV_BITS": str(kv_bits)}
    home.mkdir()
    srv = LocalServer(model, home, *extra, env=env)
    threading.Thread(target=lambda: [None for _ in srv.proc.stdout], daemon=True).start()  # keep stdout drained
    sampler = Sampler(srv)
    try:
        first = Load(srv, tok, no_eos)
        if warm is None:
            first.start("The provider node serves", 4)
        else:  # an image through the tower: its code compiled, the processor loaded, before anything is measured
            first.chat(warm, 4)
        first.join(time.monotonic() + 300)
        sampler.start()
        time.sleep(0.5)
        base = sampler.latest().get("memory", {})
        missing = [k for k in ("mlx_active_bytes", "reserved_bytes", "models_bytes", "jobs_kv_bytes",
                               "prefix_cache_bytes") if k not in base]
        if missing:
            print(f"  /health memory lacks: {', '.join(missing)}")
        print(describe("start", sampler.samples))
        time.sleep(IDLE_SAMPLE)
        for name, title, run in phases:
            # What the process holds outside the ledger at rest (interpreter, libraries, tokenizers, MLX's pool).
            before = [s["rss"] - s["memory"]["reserved_bytes"] for s in sampler.samples[-20:]]
            outside = sorted(before)[len(before) // 2]
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
            rss_over = [s for s in busy + rest if s["rss"] > rss_bound(s, outside)]
            rss_worst = max((s["rss"] - rss_bound(s, outside) for s in busy + rest), default=0)
            judged_rss = warm is not None
            ok = not over and finished and drained and (not rss_over or not judged_rss)
            verdict = "PASS" if ok else "FAIL"
            print(f"phase {name}: {title}: {seconds:.1f} s, jobs {load.ok} ok, {load.dropped} dropped, "
                  f"{load.failed} failed, {load.tokens} tokens{'' if finished else ', TIMED OUT'}"
                  f"{'' if drained else ', jobs still running at idle'}")
            for error in sorted(set(load.errors))[:3]:
                print(f"  refused: {error}")
            print(describe("peak", busy))
            print(describe("idle", rest))
            if load.turns:
                print_turns(load.turns)
            if speculation != "off":
                c = sampler.latest().get("counters", {})
                print(f"  speculation: {c.get('spec_drafted', 0)} drafted, {c.get('spec_accepted', 0)} accepted, "
                      f"{c.get('spec_target_forwards', 0)} target forwards (the node's totals)")
            peak_rss = max(busy, key=lambda s: s["rss"] - s["memory"]["reserved_bytes"], default=None)
            if peak_rss is not None:
                print(f"  RSS   {peak_rss['rss'] / MiB:8.1f} MiB at its furthest past the ledger "
                      f"({peak_rss['memory']['reserved_bytes'] / MiB:.1f} MiB); outside the ledger at rest "
                      f"{outside / MiB:.1f} MiB; {len(rss_over)} of {len(busy) + len(rest)} samples over ledger x "
                      f"1.10 + 64 MiB (worst by {rss_worst / MiB:+.1f} MiB){'' if judged_rss else ' (not judged)'}")
            print(f"  verdict {verdict}: {len(over)} of {len(busy) + len(rest)} samples over ledger x 1.10 + "
                  f"16 MiB (worst by {worst / MiB:+.1f} MiB)", flush=True)
            results.append({"phase": name, "title": title, "verdict": verdict, "seconds": seconds,
                            "ok": load.ok, "dropped": load.dropped, "failed": load.failed,
                            "samples_over": len(over), "rss_samples_over": len(rss_over),
                            "samples": len(busy) + len(rest), "outside_ledger_bytes": outside,
                            "turns": load.turns})
    finally:
        sampler.stopping.set()
        srv.stop()
        samples += sampler.samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write every /health sample and the verdicts as JSON")
    ap.add_argument("--phases", default="abcdeqmfw", help="the phases to run (default: all)")
    ap.add_argument("--m-speculation", choices=("on", "off"), default="on",
                    help="phases m and f's speculation policy")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results: list[dict] = []
    samples: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        text = [p for p in TEXT_PHASES if p[0] in args.phases]
        if text:
            model, no_eos = build_model(Path(tmp) / "llama-kv-heavy")
            print(f"model {model.name}: 4 layers, 8 KV heads x 32, fp32 (8 KiB KV/token); /health every 50 ms")
            serve(model, no_eos, Path(tmp) / "home", text, rng, None, results, samples)
        images = [p for p in IMAGE_PHASES if p[0] in args.phases]
        if images:
            model, no_eos = build_vlm(Path(tmp) / "gemma4-vlm")
            print(f"model {model.name}: Gemma 4 text model with a 2-layer vision tower, 280 soft tokens an image "
                  "(1,120 at detail high); /health and RSS every 50 ms")
            serve(model, no_eos, Path(tmp) / "home-vlm", images, rng,
                  [image_part(1, (320, 240), "auto"), {"type": "text", "text": "What is it?"}], results, samples)
        agents = [p for p in AGENT_PHASES if p[0] in args.phases]
        if agents:
            model, no_eos = build_model(Path(tmp) / "llama-kv-heavy-32k", AGENT_CONTEXT)
            print(f"model {model.name}: the same Llama, context {AGENT_CONTEXT}; /health every 50 ms")
            serve(model, no_eos, Path(tmp) / "home-agents", agents, rng, None, results, samples)
        quantized = [p for p in QUANT_PHASES if p[0] in args.phases]
        if quantized:
            model, no_eos = build_model(Path(tmp) / "llama-kv-heavy-q")
            print(f"model {model.name}: the same Llama, KV quantized to 4 bits (1.5 KiB KV/token); /health every 50 ms")
            serve(model, no_eos, Path(tmp) / "home-q", quantized, rng, None, results, samples, kv_bits=4)
        speculating = [p for p in SPEC_PHASES if p[0] in args.phases]
        if speculating:
            model, no_eos = build_hybrid(Path(tmp) / "qwen3_5-mtp")
            print(f"model {model.name}: hybrid Qwen3.5, 8 layers (6 Gated DeltaNet), fp32, with its MTP head; "
                  f"speculation {args.m_speculation}, k = 3; /health every 50 ms")
            serve(model, no_eos, Path(tmp) / "home-m", speculating, rng, None, results, samples,
                  speculation=args.m_speculation)
        dflash = [p for p in DFLASH_PHASES if p[0] in args.phases]
        if dflash:
            model, drafter = build_dflash(Path(tmp) / "qwen3-kv-heavy")
            print(f"model {model.name}: Qwen3, 4 layers, 8 KV heads x 32, fp32 (8 KiB KV/token), with an untrained "
                  f"2-layer DFlash drafter (4 KiB context K/V a token); speculation {args.m_speculation}, k = 3")
            serve(model, [], Path(tmp) / "home-f", dflash, rng, None, results, samples,
                  speculation=args.m_speculation, extra=("--drafter", str(drafter)))
        windowed = [p for p in WINDOWED_PHASES if p[0] in args.phases]
        if windowed:
            model, drafter = build_windowed(Path(tmp) / "muse-kv-heavy")
            print(f"model {model.name}: Muse Glimmer, 4 layers, 16 KV heads x 64, fp32, with an untrained 2-layer "
                  f"MuseGlimmer assistant of window 128 (16 KiB context K/V a token, 2 MiB a row at most); "
                  f"speculation {args.m_speculation}, k = 3")
            serve(model, [], Path(tmp) / "home-w", windowed, rng, None, results, samples,
                  speculation=args.m_speculation, extra=("--drafter", str(drafter)))
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "phases": results, "samples": samples}, indent=1))
    verdicts = ", ".join(f"{r['phase']} {r['verdict']}" for r in results)
    print(f"verdicts: {verdicts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
