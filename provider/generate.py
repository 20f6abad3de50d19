"""`provider generate`: one answer from the command line, through the same engine as a job (loading, memory
admission, batching, speculation, grammars), with no listener.

The text streams to stdout as it is generated; the job's telemetry goes to stderr at the end (or, with
`--json`, one JSON object on stdout holds the text, the finish reason, usage and telemetry). Errors are one
line on stderr and a sysexits code. Ctrl-C cancels the job within one engine step; what was generated stays
printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
from pathlib import Path

from .jobs import Done, Error, Job, SamplingParams, Tokens
from .types import Cause, JobError, SpecMode

EX_USAGE_FLAG = 2  # a bad flag value: as argparse exits
EX_DATAERR = 65  # the prompt or the schema is refused
EX_NOINPUT = 66  # no prompt, or a file that cannot be read
EX_UNAVAILABLE = 69  # the model cannot be loaded, or a feature this node does not have
EX_SOFTWARE = 70
EX_TEMPFAIL = 75  # not enough memory now, or the daemon holds the same model
EXIT_INTERRUPTED = 130  # Ctrl-C: the job was cancelled; what it generated was printed
CAUSE_EXIT = {Cause.INVALID_REQUEST: EX_DATAERR, Cause.CONTEXT_LENGTH_EXCEEDED: EX_DATAERR,
              Cause.SPECULATION_UNAVAILABLE: EX_UNAVAILABLE, Cause.UNKNOWN_MODEL: EX_NOINPUT,
              Cause.MODEL_LOAD_FAILED: EX_UNAVAILABLE, Cause.INSUFFICIENT_MEMORY: EX_TEMPFAIL,
              Cause.OVERLOADED: EX_TEMPFAIL}

HELP = """Generate one answer for PROMPT (or standard input) and print it as it comes.

Runs beside a daemon on the same state directory unless that daemon already holds the model asked for: loading
it twice in one memory budget is refused (exit 75); send the request to the daemon instead."""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="one answer from the command line, with the engine's speculation",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    p.add_argument("--model", help="model directory or Hugging Face repo id (default: the bundled model)")
    p.add_argument("--drafter", help="Gemma 4 assistant or same-vocabulary draft model for --model")
    p.add_argument("--speculation", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy, as mlx_lm.generate")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--system", help="a system message before the prompt")
    p.add_argument("--json-schema", type=Path, metavar="FILE", help="answer as JSON that follows this JSON Schema")
    p.add_argument("--image", type=Path, action="append", help="an image for the prompt (not in this node yet)")
    p.add_argument("--raw", action="store_true", help="the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: text, usage, telemetry")
    p.add_argument("--config", type=Path, help="TOML config file")

    def one_line(message: str):  # a bad flag is one line, not argparse's usage block
        print(f"provider generate: {message} (see provider generate --help)", file=sys.stderr)
        sys.exit(EX_USAGE_FLAG)

    p.error = one_line


def run(args: argparse.Namespace) -> int:
    try:
        job = _job(args)
        return asyncio.run(_generate(args, job))
    except _Refused as e:
        return _fail(e.message, e.code)
    except JobError as e:
        return _fail(e.message, CAUSE_EXIT.get(e.cause, EX_SOFTWARE))


class _Refused(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.message, self.code = message, code


def _fail(message: str, code: int) -> int:
    print(f"provider generate: {message}", file=sys.stderr)
    return code


def _job(args: argparse.Namespace) -> Job:
    """The job, with every flag checked before anything is loaded."""
    from .constraints import OutputRules, ResponseFormat

    if args.image:
        raise _Refused("--image needs image input (the vision issue), which this node does not have yet",
                       EX_UNAVAILABLE)
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise _Refused("no prompt: pass PROMPT or pipe it on standard input", EX_NOINPUT)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise _Refused("the prompt is empty", EX_NOINPUT)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed)
    except JobError as e:
        raise _Refused(f"--{e.param.replace('_', '-')}: {e.message}", EX_USAGE_FLAG) from None
    rules = OutputRules()
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise _Refused(f"--json-schema {args.json_schema}: {e}", EX_NOINPUT) from None
        name = re.sub(r"[^A-Za-z0-9_-]", "_", args.json_schema.stem)[:64] or "schema"
        rules = OutputRules(ResponseFormat("json_schema", schema, name))
    if args.raw:
        if args.system:
            raise _Refused("--system needs the chat template; drop --raw", EX_USAGE_FLAG)
        return Job("generate", args.model or "", sampling, prompt=prompt, speculation=args.speculation, rules=rules)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": prompt}]
    return Job("generate", args.model or "", sampling, messages=tuple(messages), speculation=args.speculation,
               rules=rules)


def _settings(args: argparse.Namespace):
    from .settings import Settings, SettingsError

    try:
        return Settings.load(cli={"model": args.model, "drafter": args.drafter, "speculation": args.speculation,
                                  "log_level": "warning", "log_format": "console"}, config_file=args.config)
    except SettingsError as e:
        raise _Refused(f"configuration error: {e}", EX_USAGE_FLAG) from None


def _check_daemon(model_id: str) -> None:
    """Refuse only when a daemon on this state directory already holds the same model."""
    from . import paths, status_file
    from .startup import holder_pid

    state = paths.state_dir()
    pid = holder_pid(state)
    body = status_file.read(state) if pid else None
    held = {m["id"] for m in (body or {}).get("models", []) if m.get("state") != "available"}
    if model_id in held:
        raise _Refused(f"the daemon (pid {pid}) already holds {model_id}; loading it again in the same memory "
                       "budget is refused: send the request to the daemon, or stop it", EX_TEMPFAIL)


async def _generate(args: argparse.Namespace, job: Job) -> int:
    from dataclasses import replace

    from . import logs
    from .models.default import primary_models
    from .node import Node, build_models

    settings = _settings(args)
    logs.configure(settings.log_level, settings.log_format, file=settings.log_file)
    node = Node(settings, build_models(settings, primary_models(settings)))
    model_id = node.resolve_model(args.model)
    _check_daemon(model_id)
    job = replace(job, model=model_id)
    node.start()
    loop = asyncio.get_running_loop()
    interrupted = []
    loop.add_signal_handler(signal.SIGINT, lambda: (interrupted.append(True), node.cancel(job.id)))
    text, end = [], None
    try:
        async with node.run(job) as stream:
            async for ev in stream:
                if isinstance(ev, Tokens):
                    text.append(ev.text)
                    if not args.json:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                elif isinstance(ev, (Done, Error)):
                    end = ev
    finally:
        await node.stop(grace_s=0)
    if isinstance(end, Error):
        if not args.json and text:
            print()
        return _fail(f"{end.cause.value}: {end.message}", CAUSE_EXIT.get(end.cause, EX_SOFTWARE))
    if args.json:
        print(json.dumps({"model": model_id, "text": "".join(text), "finish_reason": end.finish_reason.value,
                          "usage": end.usage.as_dict(), "telemetry": end.telemetry.as_dict()}))
    else:
        print()
        print(summary(end), file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else 0


def summary(done: Done) -> str:
    t, s = done.telemetry, done.telemetry.speculation
    parts = [f"{done.usage.completion_tokens} tokens, finish {done.finish_reason.value}"]
    if t.ttft_ms is not None:
        parts.append(f"ttft {t.ttft_ms:.0f} ms")
    if t.decode_tokens_per_s is not None:
        parts.append(f"{t.decode_tokens_per_s:.1f} tok/s")
    if s.mode != "off":
        parts.append(f"speculation {SpecMode(s.mode).value} k={s.k}: acceptance {s.acceptance_rate:.2f}, "
                     f"{s.tokens_per_target_forward:.2f} tokens per target forward")
    else:
        parts.append(f"speculation off ({s.reason})")
    origin = getattr(s.choice, "origin", None)  # auto decided from costs kept from an earlier run, or measured now
    if origin is not None:
        parts.append(f"costs {'from the kept profile' if origin.source == 'file' else 'measured'} "
                     f"{origin.as_dict()['measured_at']}")
    return "; ".join(parts)
