"""Fault injection for tests of the engine's supervision: the real `provider` CLI, where any model loaded
from a directory named `faulty-*` raises in its forward once it sees a real prompt (warm-up passes).

    python -m tests.faulty_node start --local --model DIR/faulty-llama ...

`FAULT=kill` raises `EngineKill`, a BaseException that escapes every per-job handler, as a fault in the
loop itself would; `FAULT=hang` blocks the forward for an hour (a wedged engine: the process lives, the loop
stops ticking); any other value raises a RuntimeError, which must fail only the job that hit it.
"""

from __future__ import annotations

import os
import sys
import time


class EngineKill(BaseException):
    """Not an Exception: no per-job handler catches it, so it ends the engine loop."""


class RaisingModel:
    """Wraps an mlx-lm model; its forward raises for any input wider than one token (a prompt prefill)."""

    def __init__(self, model, error: BaseException):
        self._model = model
        self._error = error

    def __call__(self, inputs, *args, **kwargs):
        if inputs.shape[-1] > 1:
            if self._error is None:
                time.sleep(3600)
            raise self._error
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def install(kind: str) -> None:
    from provider.models import loader

    real_load = loader.load

    def load(model_id, path, *args, **kwargs):
        lm = real_load(model_id, path, *args, **kwargs)
        if path.name.startswith("faulty-"):
            error = (EngineKill("injected") if kind == "kill" else None if kind == "hang"
                     else RuntimeError("injected forward failure"))
            lm.model = RaisingModel(lm.model, error)
        return lm

    loader.load = load


if __name__ == "__main__":
    install(os.environ.get("FAULT", "kill"))
    from provider.commands.cli import main

    sys.exit(main())
