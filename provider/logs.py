"""structlog set-up: console on a TTY, JSON lines otherwise; a size-bounded file when the node keeps its own log;
and a throttle for lines a peer can make the node repeat.

House rule: log ids, counts and timings; never prompt or completion text.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import time
from dataclasses import dataclass


_rich_kept_out = False  # whether _import_structlog kept Rich out of structlog.dev


def _import_structlog():
    """structlog, without Rich. structlog.dev imports Rich (and Pygments) whenever it is installed, only for the
    console renderer's tracebacks: 0.05 to 0.15 s of every start, on a terminal too (`provider generate` there).
    A console renderer still renders its tracebacks with Rich, which it imports with the first one it renders
    (`RichTracebackFormatter`, `_console_renderer`)."""
    if "structlog" in sys.modules or "rich" in sys.modules:
        import structlog

        return structlog
    global _rich_kept_out
    _rich_kept_out = True
    sys.modules["rich"] = None  # `import rich` raises ImportError while this holds: structlog takes it as absent
    try:
        import structlog
    finally:
        if sys.modules.get("rich", 0) is None:
            del sys.modules["rich"]
    return structlog


structlog = _import_structlog()

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

# The setting `log_file` (PROVIDER_LOG_FILE) names the node's own log file, rotated by size: the launchd agent
# sets it, since launchd's own redirect never rotates.
LOG_FILE_ENV = "PROVIDER_LOG_FILE"
LOG_FILE_MAX_BYTES = 16 << 20  # then provider.log becomes provider.log.1, and so on
LOG_FILE_BACKUPS = 3  # so the files hold at most 64 MiB
_EVENTS = "provider.events"  # the stdlib logger structlog's lines go through, to the same handler as libraries'

# A line an attacker can make the node repeat (one per unusable frame, per repeated job id) passes a token bucket
# per key: THROTTLE_BURST at once, then THROTTLE_PER_S a second; what it drops is counted and said in a
# `log_suppressed` line at most every THROTTLE_SUMMARY_S while it goes on, and when its owner flushes.
THROTTLE_BURST = 10
THROTTLE_PER_S = 1.0
THROTTLE_SUMMARY_S = 60.0
THROTTLE_KEYS = 64  # keys come from closed sets; past this many, new ones share one bucket
CLIP_CHARS = 200  # free text from a peer (a Reject's reason, a version string) is cut to this in a log line


def configure(level: str = "info", fmt: str = "auto", stream=None, file: str = "", *,
              max_bytes: int = LOG_FILE_MAX_BYTES, backups: int = LOG_FILE_BACKUPS) -> None:
    """Every line, structlog's and the libraries' (aiohttp, grpc, asyncio), through one handler: `stream`
    (stderr by default), or `file` (the `log_file` setting) rotated at `max_bytes` keeping `backups` old files."""
    handler, tty = None, False
    if file:
        try:
            handler = logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes, backupCount=backups,
                                                           encoding="utf-8")
        except OSError as e:  # a log that cannot be written must not stop the node: stderr, and say why
            print(f"provider: cannot write the log file {file} ({e}); logging to stderr", file=sys.stderr)
    if handler is None:
        stream = stream or sys.stderr
        handler, tty = logging.StreamHandler(stream), stream.isatty()
    use_console = fmt == "console" or (fmt == "auto" and tty)
    renderer = _console_renderer() if use_console else structlog.processors.JSONRenderer()
    shared = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, logging.FileHandler):  # ours, from an earlier call: its file is let go
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.INFO))  # libraries' debug lines stay out even at debug
    server = logging.getLogger("aiohttp.server")
    server.filters[:] = [f for f in server.filters if not isinstance(f, MalformedRequests)] + [MalformedRequests()]
    events = logging.getLogger(_EVENTS)
    events.setLevel(_LEVELS[level])  # structlog has filtered by level already
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *_: events,
        cache_logger_on_first_use=False,
    )


def _console_renderer():
    """structlog's console renderer with its default exception formatter: Rich's tracebacks when Rich is installed,
    also when structlog was imported without it (`_import_structlog`): Rich is imported then by the first
    traceback rendered."""
    dev = structlog.dev
    if not _rich_kept_out:
        return dev.ConsoleRenderer()
    import importlib.util

    if importlib.util.find_spec("rich") is None:
        return dev.ConsoleRenderer()  # not installed: structlog's own fallback, as before
    return dev.ConsoleRenderer(exception_formatter=RichTracebackFormatter())


class RichTracebackFormatter(structlog.dev.RichTracebackFormatter):
    """structlog's Rich traceback formatter (its fields, defaults and repr), importing Rich for the names
    structlog.dev's formatter reads when it first renders, rather than at every start."""

    def __call__(self, sio, exc_info) -> None:
        dev = structlog.dev
        if dev.rich is None:
            import rich
            from rich.console import Console
            from rich.traceback import Traceback

            dev.rich, dev.Console, dev.Traceback = rich, Console, Traceback
        super().__call__(sio, exc_info)


def get(name: str):
    return structlog.get_logger(name)


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """Free text a peer chose, cut for a log line: a 64 MiB Reject reason must not become a 64 MiB line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class _Bucket:
    tokens: float
    at: float  # when `tokens` was last refilled
    suppressed: int = 0
    summarized_at: float = 0.0


class Throttle:
    """Token buckets per event key, for lines a peer can make the node repeat. The key is an event name and a
    kind from a closed set, never a value off the wire. `clock` is injectable, so the decisions are testable."""

    def __init__(self, *, burst: int = THROTTLE_BURST, per_s: float = THROTTLE_PER_S,
                 summary_s: float = THROTTLE_SUMMARY_S, clock=time.monotonic):
        self.burst, self.per_s, self.summary_s, self.clock = burst, per_s, summary_s, clock
        self._buckets: dict[str, _Bucket] = {}

    def admit(self, key: str) -> tuple[bool, int]:
        """Whether a line of `key` goes out now, and how many dropped lines are due to be summarized now (0
        unless a summary is due: every `summary_s` while lines are dropped)."""
        now = self.clock()
        if key not in self._buckets and len(self._buckets) >= THROTTLE_KEYS:
            key = "other"
        b = self._buckets.setdefault(key, _Bucket(float(self.burst), now, summarized_at=now))
        b.tokens, b.at = min(float(self.burst), b.tokens + (now - b.at) * self.per_s), now
        if b.tokens >= 1:
            b.tokens -= 1
            return True, 0
        b.suppressed += 1
        if now - b.summarized_at < self.summary_s:
            return False, 0
        due, b.suppressed, b.summarized_at = b.suppressed, 0, now
        return False, due

    def log(self, logger, level: str, event: str, kind: str = "", **fields) -> None:
        """`logger.<level>(event, **fields)` unless throttled under the key `event:kind`."""
        key = f"{event}:{kind}" if kind else event
        admitted, due = self.admit(key)
        if admitted:
            getattr(logger, level)(event, **fields)
        elif due:
            logger.warning("log_suppressed", key=key, suppressed=due, seconds=self.summary_s)

    def flush(self, logger) -> None:
        """Say what was dropped and not yet summarized (at the end of a session, say)."""
        for key, b in self._buckets.items():
            if b.suppressed:
                logger.warning("log_suppressed", key=key, suppressed=b.suppressed,
                               seconds=round(self.clock() - b.summarized_at, 3))
                b.suppressed, b.summarized_at = 0, self.clock()


class MalformedRequests(logging.Filter):
    """aiohttp logs a client's malformed request (a bad Host, a broken header; answered 400 already) with its whole
    traceback: lines a stranger makes the node write at will. Each becomes one line naming the error, throttled."""

    def __init__(self):
        super().__init__()
        self.throttle = Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or type(error).__module__ != "aiohttp.http_exceptions":
            return True
        admitted, due = self.throttle.admit(type(error).__name__)
        record.exc_info, record.exc_text, record.args = None, None, ()
        record.levelno, record.levelname = logging.INFO, "INFO"  # the client's fault, not the node's
        record.msg = f"malformed request refused: {type(error).__name__}" + (f" ({due} more not logged)" if due else "")
        return admitted or bool(due)
