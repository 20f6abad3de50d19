"""structlog set-up: console on a TTY, JSON lines otherwise.

House rule: log ids, counts and timings; never prompt or completion text.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", stream=None) -> None:
    stream = stream or sys.stderr
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    shared = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    # Libraries log through the standard library (aiohttp, grpc, asyncio): render them the same way, so a
    # JSON log stays one JSON object per line.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.INFO))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get(name: str):
    return structlog.get_logger(name)
