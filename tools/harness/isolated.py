"""A call in a Python process of its own, for figures that are process-wide: MLX's active and peak memory, RSS,
CPU time. In a test's own process anything else moves them: another test's threads in the same pytest-xdist
worker, MLX work still queued on its streams (mlx-lm's generate_step evaluates the next token ahead), garbage
collected mid-measurement.

    result = run_isolated(some_module.measure, "arg", 3)

`measure` is a top-level function of an importable module; its arguments and its result are JSON. What it
prints is written to this process's stderr; an exception in it fails the call with the child's traceback.

    python -m tools.harness.isolated MODULE:FUNCTION RESULT_FILE < ARGS_JSON
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]


class IsolatedCallFailed(AssertionError):
    """The call raised in its own process (an assertion there fails the test here)."""


def run_isolated(func: Callable[..., Any], *args: Any, timeout: float = 600) -> Any:
    """`func(*args)` in a fresh `python -m tools.harness.isolated`, its environment this process's."""
    target = f"{func.__module__}:{func.__qualname__}"
    with tempfile.TemporaryDirectory(prefix="isolated-") as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-m", "tools.harness.isolated", target, str(result)],
                              input=json.dumps(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, cwd=ROOT)
        sys.stderr.write(proc.stdout)  # what it printed, for the test's captured output
        if proc.returncode != 0:
            raise IsolatedCallFailed(f"{target} failed in its own process (exit {proc.returncode}):\n"
                                     f"{proc.stdout[-4000:]}")
        return json.loads(result.read_text())


def _main(target: str, result: str) -> None:
    module, _, name = target.partition(":")
    func = importlib.import_module(module)
    for part in name.split("."):
        func = getattr(func, part)
    Path(result).write_text(json.dumps(func(*json.loads(sys.stdin.read()))))


if __name__ == "__main__":
    _main(*sys.argv[1:])
    # Leave without the interpreter's teardown, as provider.commands.cli._leave does: after MLX ran on worker threads,
    # MLX 0.32's CPU backend sometimes aborts there ("terminate called without an active exception") once the
    # result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
