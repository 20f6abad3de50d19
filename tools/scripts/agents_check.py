"""Coding agents against `provider start --local` (issue 38): Claude Code over Anthropic's Messages API and Codex
CLI over OpenAI's Responses API, each for two turns, headless and offline.

- Installs `@anthropic-ai/claude-code` and `@openai/codex` from npm into --cache (once; npm's registry is the
  only network it needs).
- Builds a fixture model with the real factory (tools.fixtures.factory): a small Llama whose tokenizer is
  trained on this repository's docs and code, with a 64k context, room for the agents' 10-25k-token system
  prompts and tool lists. Its weights are random: the agents get nonsense back, which is all this needs.
- Starts the node on it, with max_tokens capped (the agents ask 32000; the node clamps, says so in telemetry).
- Runs `claude -p` then `claude -p --continue`, and `codex exec` then `codex exec resume --last`, each with
  telemetry, update checks and every other network call off, and checks each exits 0.
- Reads the node's log: each agent's tools accepted (the `agent_request` lines), and per turn the time to
  first token of its first tool-carrying request; prints turn 2's TTFT ÷ turn 1's (target <= 0.15: the prefix
  cache must make later turns cheap).

    python tools/scripts/agents_check.py [--cache DIR] [--keep DIR] [--bundled]

Exit 0 when both agents completed both turns, their tools were accepted and each ratio is <= 0.15.

With --bundled, out of the box instead (issue 58): the node is `provider start --local` as the README starts it,
the agents talk to its bundled chat variant (`gemma4-demo-chat`), and each is set up with docs/api.md's settings
and no others that change what it does (no max_tokens cap, no longer timeouts; a home of its own, and RUST_LOG to
quiet Codex's log). Exit 0 when both agents completed both turns with their
tools accepted; the ratio is printed (a first turn reads the agent's whole prompt: minutes on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.harness.daemon import LocalServer  # noqa: E402

PACKAGES = ["@anthropic-ai/claude-code", "@openai/codex"]
MODEL = "agent-tiny"
CONTEXT = 65536
VOCAB = 8192
MAX_TOKENS = 48  # the node's limit: a random model's answer stops here
TARGET = 0.15
TURNS = ("Say hello in one line.", "Now say goodbye.")  # as docs/api.md prints them


def install(cache: Path) -> dict[str, Path]:
    bins = {"claude": cache / "node_modules/.bin/claude", "codex": cache / "node_modules/.bin/codex"}
    if not all(p.exists() for p in bins.values()):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", *PACKAGES], check=True)
    return bins


def corpus() -> list[str]:
    """English prose and code to train the fixture's tokenizer on: this repository's docs and sources."""
    texts = [p.read_text(errors="replace") for pattern in ("*.md", "docs/*.md", "provider/**/*.py")
             for p in sorted(ROOT.glob(pattern))]
    return [t for t in texts if t][:400]


def build_model(root: Path) -> Path:
    from tools.fixtures import factory

    out = root / MODEL
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = factory.build_tokenizer(out, VOCAB, factory.CHATML_TEMPLATE, "<eos>", add_bos=True, corpus=corpus())
    config = factory._llama_config(ids, VOCAB, 64, 2) | {"max_position_embeddings": CONTEXT}
    factory._save(out, config, ending(factory._random_weights(config, seed=38), ids["<|im_end|>"]))
    return out


def ending(weights: dict, end: int) -> dict:
    """Random weights that end their turn after a few tokens: every embedding carries a constant in dimension 0,
    which only the end token's head row reads (p(end) about 0.13 a step at temperature 1). Agents treat an
    answer cut at max_tokens as an error; a real model ends its turn, and so must this one."""
    import mlx.core as mx
    import numpy as np

    embed = np.array(weights["model.embed_tokens.weight"])
    embed[:, 0] = 1.0
    head = np.array(weights["lm_head.weight"])
    head[:, 0] = 0.0
    head[end] = 0.0
    head[end, 0] = 2.0
    return weights | {"model.embed_tokens.weight": mx.array(embed), "lm_head.weight": mx.array(head)}


def run(name: str, args: list[str], env: dict, cwd: Path, timeout: float = 3600) -> tuple[int, float, str]:
    started = time.monotonic()
    p = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                       stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    print(f"  {name}: exit {p.returncode} in {took:.1f}s; stdout {p.stdout.strip()[:160]!r}")
    if p.returncode != 0:
        print(f"  stderr: {p.stderr.strip()[-2000:]}")
    return p.returncode, took, p.stdout


def claude_env(base: dict, srv: LocalServer, home: Path, documented: bool = False) -> dict:
    if documented:  # docs/api.md's settings, and nothing else
        return base | {"HOME": str(home), "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": srv.token,
                       "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
                       "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
                       "API_TIMEOUT_MS": "3600000"}
    return base | {
        "HOME": str(home), "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": srv.token,
        "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        # offline: no telemetry, error reports, update checks or other calls home
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "DISABLE_COST_WARNINGS": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1", "API_TIMEOUT_MS": "900000",
    }


def codex_env(base: dict, srv: LocalServer, home: Path, documented: bool = False) -> dict:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    config = f"""model = "{MODEL}"
model_provider = "local"
check_for_update_on_startup = false

[model_providers.local]
name = "provider node"
base_url = "{srv.url}/v1"
env_key = "PROVIDER_API_KEY"
wire_api = "responses"
"""
    if not documented:  # docs/api.md's config ends above
        config += """stream_idle_timeout_ms = 900000
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
exporter = "none"
"""
    (codex_home / "config.toml").write_text(config)
    return base | {"HOME": str(home), "CODEX_HOME": str(codex_home), "PROVIDER_API_KEY": srv.token,
                   "RUST_LOG": "error"}


def log_lines(srv: LocalServer) -> list[dict]:
    out = []
    for line in srv.logs().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def turn_figures(lines: list[dict], api: str, since: int, until: int) -> dict | None:
    """The first tool-carrying request of an agent's turn (log lines since..until): its tools, prompt and TTFT."""
    for i in range(since, until):
        line = lines[i]
        if line.get("event") == "agent_request" and line.get("api") == api and line.get("tools"):
            job = line["job_id"]
            started = next((x for x in lines[since:until] if x.get("event") == "job_started" and x.get("job_id") == job), {})
            done = next((x for x in lines[i:until] if x.get("event") == "job_finished" and x.get("job_id") == job), {})
            return {"job": job, "tools": line["tools"], "left_out": line.get("left_out"),
                    "prompt_tokens": started.get("prompt_tokens"), "cached": done.get("cached_prompt_tokens"),
                    "ttft_ms": done.get("ttft_ms")}
    return None


def agent(name: str, api: str, commands: list[list[str]], env: dict, work: Path, srv: LocalServer) -> dict:
    print(f"{name}:")
    figures, ok = [], True
    for args in commands:
        before = len(log_lines(srv))
        code, _, _ = run(name, args, env, work)
        lines = log_lines(srv)
        fig = turn_figures(lines, api, before, len(lines))
        requests = sum(1 for x in lines[before:] if x.get("event") == "agent_request" and x.get("api") == api)
        print(f"    requests {requests}; first with tools: {fig}")
        ok = ok and code == 0 and fig is not None and fig["ttft_ms"] is not None
        figures.append(fig)
    ratio = None
    if ok:
        ratio = figures[1]["ttft_ms"] / figures[0]["ttft_ms"]
        print(f"  {name}: TTFT turn 2 / turn 1 = {figures[1]['ttft_ms']:.1f} / {figures[0]['ttft_ms']:.1f} ms "
              f"= {ratio:.3f} (prompt {figures[0]['prompt_tokens']} -> {figures[1]['prompt_tokens']} tokens, "
              f"{figures[1]['cached']} cached; {figures[0]['tools']} tools accepted)")
    return {"ok": ok, "ratio": ratio, "turns": figures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "provider-agents-cache")
    ap.add_argument("--keep", type=Path, default=None, help="work here and keep it (default: a temp dir)")
    ap.add_argument("--only", choices=["claude", "codex"], default=None)
    ap.add_argument("--bundled", action="store_true", help="the README's node and its chat variant, as documented")
    args = ap.parse_args()
    global MODEL
    bins = install(args.cache)
    work = args.keep or Path(tempfile.mkdtemp(prefix="agents-check-"))
    work.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "USER")}
    (work / "node").mkdir(exist_ok=True)
    if args.bundled:
        from provider.models.default import DEMO_CHAT

        MODEL = DEMO_CHAT.name
        print(f"model {MODEL}, bundled, beside the default; work in {work}")
        srv = LocalServer(None, work / "node")
    else:
        model = build_model(args.cache / "models")
        print(f"model {model} (context {CONTEXT}); work in {work}")
        srv = LocalServer(model, work / "node", env={"PROVIDER_MAX_TOKENS_LIMIT": str(MAX_TOKENS),
                                                     "PROVIDER_DEFAULT_MAX_TOKENS": str(MAX_TOKENS)})
    results = {}
    try:
        project = work / "project"
        project.mkdir(exist_ok=True)
        (project / "README.md").write_text("A small project.\n")
        if args.only in (None, "claude"):
            env = claude_env(base, srv, work / "claude-home", documented=args.bundled)
            claude = [str(bins["claude"]), "-p"] + ([] if args.bundled else
                                                    ["--output-format", "text", "--model", MODEL])
            results["claude"] = agent("claude", "anthropic_messages",
                                      [claude + [TURNS[0]], claude + ["--continue", TURNS[1]]], env, project, srv)
        if args.only in (None, "codex"):
            env = codex_env(base, srv, work / "codex-home", documented=args.bundled)
            codex = [str(bins["codex"]), "exec", "--skip-git-repo-check"] + ([] if args.bundled else
                                                                              ["--color", "never"])
            results["codex"] = agent("codex", "openai_responses",
                                     [codex + [TURNS[0]], codex + ["resume", "--last", TURNS[1]]], env, project, srv)
    finally:
        code = srv.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: {"ok": v["ok"], "ttft_ratio": v["ratio"]} for k, v in results.items()}))
    good = code == 0 and results and all(v["ok"] and (args.bundled or v["ratio"] <= TARGET)
                                         for v in results.values())
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
