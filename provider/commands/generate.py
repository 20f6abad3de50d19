"""`provider generate`: one answer from the command line, through the same engine as a job (loading, memory
admission, batching, speculation, grammars), with no listener.

The text streams to stdout as it is generated; the job's telemetry goes to stderr at the end (or, with
`--json`, one JSON object on stdout holds the text, the finish reason, usage and telemetry). Errors are one
line on stderr and a sysexits code. Ctrl-C cancels the job within one engine step; what was generated stays
printed.

One node per machine: when a daemon holds the state directory, the job goes to it over its control socket
(`_forward`, provider/commands/daemon_client.py) and runs there; otherwise the engine runs in this process. Either way
the job is built and checked by `generate_job.job_of`, from the JSON shape the daemon's route reads too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..generate_job import job_of, summary_of
from ..jobs import Job
from ..outputs import Done, Error, Tokens
from ..types import Cause, JobError

EX_USAGE_FLAG = 2  # a bad flag value: as argparse exits
EX_DATAERR = 65  # the prompt or the schema is refused
EX_NOINPUT = 66  # no prompt, or a file that cannot be read
EX_UNAVAILABLE = 69  # the model cannot be loaded, or a feature this node does not have
EX_SOFTWARE = 70
EX_TEMPFAIL = 75  # not enough memory now, or a daemon runs that cannot take the job
START_WAIT_S = 10.0  # how long a daemon just started may take to open its control socket
GC_OFF_AT_MOST_S = 30.0  # the collector is on again by then, loaded or not (as daemon.GC_OFF_AT_MOST_S)
EXIT_INTERRUPTED = 130  # Ctrl-C: the job was cancelled; what it generated was printed
CAUSE_EXIT = {Cause.INVALID_REQUEST: EX_DATAERR, Cause.CONTEXT_LENGTH_EXCEEDED: EX_DATAERR,
              Cause.SPECULATION_UNAVAILABLE: EX_UNAVAILABLE, Cause.UNKNOWN_MODEL: EX_NOINPUT,
              Cause.MODEL_LOAD_FAILED: EX_UNAVAILABLE, Cause.INSUFFICIENT_MEMORY: EX_TEMPFAIL,
              Cause.OVERLOADED: EX_TEMPFAIL}

HELP = """Generate one answer for PROMPT (or standard input) and print it as it comes.

When a provider daemon runs on this state directory (`provider start`, with or without --local), the job is
sent to it over its control socket and runs there, as `ollama run` does: one node, one memory budget. The
daemon resolves --model among the models it serves (an unknown one exits 66) and loads it if it is not
resident; Ctrl-C cancels the job in the daemon. --drafter and --config set the node itself, which a running
daemon has already read: they are refused then (exit 2). A daemon too old to have a control socket is
refused with exit 75. Without a daemon, the engine runs in this process."""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="one answer from the command line, with the engine's speculation",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    p.add_argument("--model", help="model directory or Hugging Face repo id (default: the bundled model)")
    p.add_argument("--drafter", help="Gemma 4 assistant or same-vocabulary draft model for --model")
    p.add_argument("--speculation", choices=["auto", "on", "off"], default="auto",
                   help="draft with the model's drafter: on, off, or where it pays (auto)")
    p.add_argument("--max-tokens", type=int, default=256, help="the most tokens the answer may have")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy, as mlx_lm.generate")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens this likely")
    p.add_argument("--seed", type=int, help="the same seed, prompt and model give the same sampled answer")
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
    # The collector stays off through the node's imports and the model's load, as `provider start` keeps it
    # (cli._start, issue 43): its collections over objects that live until the exit were ~0.4 s of CPU here.
    # `_generate` freezes what is loaded and turns it on once the first tokens come; a job sent to a daemon
    # turns it on at once.
    collecting = gc.isenabled()
    gc.disable()

    def collector_on(freeze: bool) -> None:
        if collecting and not gc.isenabled():
            if freeze:
                gc.freeze()
            gc.enable()

    try:
        body, job = _job(args)
        daemon = _find_daemon(args)
        if daemon is not None:
            collector_on(freeze=False)
            return asyncio.run(_forward(args, body, *daemon))
        return asyncio.run(_generate(args, job, collector_on))
    except Refused as e:
        return _fail(e.message, e.code)
    except JobError as e:
        return _fail(e.message, CAUSE_EXIT.get(e.cause, EX_SOFTWARE))
    except KeyboardInterrupt:  # before a job ran (loading here, or waiting for a daemon's socket)
        return _fail("interrupted", EXIT_INTERRUPTED)
    finally:
        collector_on(freeze=False)


class Refused(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.message, self.code = message, code


def _fail(message: str, code: int) -> int:
    print(f"provider generate: {message}", file=sys.stderr)
    return code


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "seed", "speculation")


def _job(args: argparse.Namespace) -> tuple[dict[str, Any], Job]:
    """The job's JSON shape (what a daemon is sent) and the job, with every flag checked before anything loads."""
    body = _body(args)
    try:
        return body, job_of(body, "generate")
    except JobError as e:
        if e.param in SAMPLING_FLAGS:
            raise Refused(f"--{e.param.replace('_', '-')}: {e.message}", EX_USAGE_FLAG) from None
        raise


def _body(args: argparse.Namespace) -> dict[str, Any]:
    if args.image:
        raise Refused("--image needs image input (the vision issue), which this node does not have yet",
                       EX_UNAVAILABLE)
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise Refused("no prompt: pass PROMPT or pipe it on standard input", EX_NOINPUT)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise Refused("the prompt is empty", EX_NOINPUT)
    body: dict[str, Any] = {"model": args.model or "", "max_tokens": args.max_tokens,
                            "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
                            "speculation": args.speculation}
    if args.json_schema is not None:
        try:
            body["json_schema"] = json.loads(args.json_schema.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise Refused(f"--json-schema {args.json_schema}: {e}", EX_NOINPUT) from None
        body["schema_name"] = re.sub(r"[^A-Za-z0-9_-]", "_", args.json_schema.stem)[:64] or "schema"
    if args.raw:
        if args.system:
            raise Refused("--system needs the chat template; drop --raw", EX_USAGE_FLAG)
        return body | {"prompt": prompt}
    return body | {"messages": ([{"role": "system", "content": args.system}] if args.system else []) +
                   [{"role": "user", "content": prompt}]}


def _settings(args: argparse.Namespace):
    from ..settings import Settings, SettingsError

    try:
        return Settings.load(cli={"model": args.model, "drafter": args.drafter, "speculation": args.speculation,
                                  "log_level": "warning", "log_format": "console"}, config_file=args.config)
    except SettingsError as e:
        raise Refused(f"configuration error: {e}", EX_USAGE_FLAG) from None


async def _generate(args: argparse.Namespace, job: Job, collector_on: Callable[[bool], None]) -> int:
    from dataclasses import replace

    from .. import logs
    from ..memory.budget import freeze_startup_heap
    from ..models.default import primary_models
    from ..node import Node, build_models

    settings = _settings(args)
    logs.configure(settings.log_level, settings.log_format, file=settings.log_file)
    node = Node(settings, build_models(settings, primary_models(settings)))
    model_id = node.resolve_model(args.model)
    job = replace(job, model=model_id)
    freeze_startup_heap(collect=False)  # node.start's, without its full collection: this process exits soon
    node.start()
    loop = asyncio.get_running_loop()
    loop.call_later(GC_OFF_AT_MOST_S, collector_on, False)  # a download or a slow load: on again meanwhile
    interrupted = []
    # Ctrl-C ends the job, and a speculation measurement the exit would otherwise wait for
    loop.add_signal_handler(signal.SIGINT, lambda: (interrupted.append(True), node.cancel(job.id),
                                                    node.models.profiler.stop()))
    out, end = Printer(args.json, "this process"), None
    try:
        async with node.run(job) as stream:
            async for ev in stream:
                if isinstance(ev, Tokens):
                    collector_on(True)  # loaded: what the imports and the load made is frozen, as the daemon's
                    out.tokens(ev.text)
                elif isinstance(ev, (Done, Error)):
                    end = ev
    finally:
        await node.stop(grace_s=0, finish_measuring=not interrupted)  # kept for the next run, unless Ctrl-C
    if isinstance(end, Error):
        return out.error(end.cause.value, end.message)
    out.done(model_id, end.finish_reason.value, end.usage.as_dict(), end.telemetry.as_dict())
    return EXIT_INTERRUPTED if interrupted else 0


def _find_daemon(args: argparse.Namespace) -> tuple[int, Path] | None:
    """The daemon running on this state directory, its pid and control socket; None when none runs (a daemon
    just starting is given START_WAIT_S to open its socket)."""
    from .. import paths
    from ..startup import holder_pid

    state = paths.state_dir()
    pid = holder_pid(state)
    if pid is None:
        return None
    from .. import status_file
    own = [flag for flag, given in (("--drafter", args.drafter), ("--config", args.config)) if given]
    if own:
        raise Refused(f"{' and '.join(own)} set{'s' if len(own) == 1 else ''} the node itself, and the daemon (pid "
                      f"{pid}) on {state} runs with its own settings; drop {' and '.join(own)} to send the job to "
                      "the daemon, or stop the daemon to run it here", EX_USAGE_FLAG)
    path = paths.control_socket(state)
    deadline = time.monotonic() + START_WAIT_S
    while not path.exists():
        if holder_pid(state) is None:
            return None  # it stopped meanwhile
        if (status_file.read(state) or {}).get("pid") == pid:  # serving, and no socket: it has none
            raise Refused(f"the daemon (pid {pid}) on {state} has no control socket to take this job (a daemon from "
                          "before `provider generate` could send it jobs, or its log says why it could not open "
                          f"{path}); restart it, or stop it to run the job here", EX_TEMPFAIL)
        if time.monotonic() > deadline:
            raise Refused(f"the provider (pid {pid}) on {state} has not opened its control socket yet (it is starting, "
                          "or it is a node group's follower rank, which takes no jobs); try again in a moment",
                          EX_TEMPFAIL)
        time.sleep(0.05)
    return pid, path


async def _forward(args: argparse.Namespace, body: dict[str, Any], pid: int, path: Path) -> int:
    """The job run by the daemon, printed as if it ran here. Ctrl-C asks the daemon to cancel it (the job then
    ends as here, with its telemetry); a second Ctrl-C, or one before the daemon took the job, hangs up, which
    cancels it too."""
    from . import daemon_client

    loop = asyncio.get_running_loop()
    out, accepted, end, interrupted = Printer(args.json, f"the daemon (pid {pid})"), {}, None, []

    async def read() -> None:
        nonlocal end
        async for ev in daemon_client.stream_generate(body, socket=path):
            if "accepted" in ev:
                accepted.update(ev["accepted"])
            elif "tokens" in ev:
                out.tokens(ev["tokens"])
            else:
                end = ev

    reader = asyncio.ensure_future(read())

    async def cancel(job_id: str) -> None:
        try:
            status, _ = await daemon_client.call("POST", f"/provider/v1/generate/{job_id}/cancel", socket=path,
                                                 timeout=10)
        except (daemon_client.Unreachable, OSError, asyncio.TimeoutError):
            status = 0
        if status != 202:
            reader.cancel()

    def interrupt() -> None:
        if interrupted or "job_id" not in accepted:
            reader.cancel()
        else:
            interrupted.append(loop.create_task(cancel(accepted["job_id"])))  # held here until it is done
        interrupted.append(True)

    loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        await reader
    except asyncio.CancelledError:
        if out.text and not args.json:
            print()
        return _fail("interrupted: hung up, which cancels the job in the daemon", EXIT_INTERRUPTED)
    except daemon_client.Unreachable as e:
        raise Refused(f"the daemon (pid {pid}) does not answer on {path} ({e}); restart it, or stop it to run "
                      "the job here", EX_TEMPFAIL) from None
    if "error" in end:
        err = end["error"]
        hint = f" (asked of the daemon, pid {pid})" if err["cause"] == Cause.UNKNOWN_MODEL else ""
        return out.error(err["cause"], f"{err['message']}{hint}")
    done = end["done"]
    out.done(accepted.get("model", ""), done["finish_reason"], done["usage"], done["telemetry"])
    return EXIT_INTERRUPTED if interrupted else 0


class Printer:
    """What the command prints of a job, run here or by the daemon: the text as it comes (or, with --json, one
    object at the end), then the telemetry line on stderr, or the error line and its exit code."""

    def __init__(self, as_json: bool, ran_in: str):
        self.as_json, self.ran_in = as_json, ran_in  # said with the telemetry: a daemon's job or this process's
        self.text: list[str] = []

    def tokens(self, text: str) -> None:
        self.text.append(text)
        if not self.as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    def error(self, cause: str, message: str) -> int:
        if not self.as_json and self.text:
            print()
        return _fail(f"{cause}: {message}", CAUSE_EXIT.get(cause, EX_SOFTWARE))

    def done(self, model: str, finish_reason: str, usage: dict[str, Any], telemetry: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps({"model": model, "text": "".join(self.text), "finish_reason": finish_reason,
                              "usage": usage, "telemetry": telemetry, "ran_in": self.ran_in}))
        else:
            print()
            print(f"{model or 'the model'} in {self.ran_in}: {summary_of(finish_reason, usage, telemetry)}",
                  file=sys.stderr)


def summary(done: Done) -> str:
    return summary_of(done.finish_reason.value, done.usage.as_dict(), done.telemetry.as_dict())
