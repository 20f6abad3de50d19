"""Test helpers that drive real parts: the CLI in a subprocess, the node in-process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from provider.jobs import Done, Error, Job, SamplingParams, Tokens
from provider.memory.budget import Budget
from provider.models.manager import ModelManager
from provider.models.store import StoredModel
from provider.node import Node
from provider.settings import Settings


class LocalServer:
    """`provider start --local` in a subprocess on an ephemeral port, with its logs kept in a file."""

    def __init__(self, model: Path | None, home: Path, *extra: str, env: dict | None = None,
                 module: str = "provider"):
        self.home = home
        self.log_path = home / "server.log"
        self.env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "XDG_CONFIG_HOME": str(home / "config"),
            "XDG_STATE_HOME": str(home / "state"),
            "XDG_CACHE_HOME": str(home / "cache"),
        } | (env or {})
        args = [sys.executable, "-m", module, "start", "--local", "--port", "0", "--log-format", "json", *extra]
        if model is not None:
            args += ["--model", str(model)]
        self._stderr = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._stderr, env=self.env, text=True)
        self.url = self._wait_for_url()
        token_file = home / "state" / "provider" / "local-api-token"
        self.token = token_file.read_text().strip() if "--no-auth" not in extra else None

    def _wait_for_url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {lines} {self.log_path.read_text()[-2000:]}")
            lines.append(line)
            m = re.search(r"(http://\S+)/v1", line)
            if m:
                return m.group(1)
        raise TimeoutError("server did not print its URL")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def logs(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._stderr.close()


def make_manager(models: dict[str, Path], budget_bytes: int = 4 << 30, drafters: dict[str, Path] | None = None,
                 **kw) -> ModelManager:
    drafters = drafters or {}
    stored = [StoredModel(k, str(v), v if v.is_dir() else None, "configured",
                          drafter=str(drafters[k]) if k in drafters else None) for k, v in models.items()]
    return ModelManager(stored, Budget(budget_bytes, 0, "test"), allow_download=False, **kw)


def make_node(models: dict[str, Path], budget_bytes: int = 4 << 30, manager_kw: dict | None = None,
              **settings) -> Node:
    node = Node(Settings(**settings), make_manager(models, budget_bytes, **(manager_kw or {})))
    node.start()
    return node


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(node: Node, job: Job):
    """Run a job to its end; return (token ids, text, terminal event, all events)."""
    ids, text, events = [], [], []
    async with node.run(job) as stream:
        async for ev in stream:
            events.append(ev)
            if isinstance(ev, Tokens):
                ids.extend(ev.token_ids)
                text.append(ev.text)
    end = events[-1]
    assert isinstance(end, (Done, Error))
    return ids, "".join(text), end, events


def run(coro):
    return asyncio.run(coro)
