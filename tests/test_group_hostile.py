"""Real worker ranks (`provider start --group HOSTFILE --rank 1`) against a rank 0 that misbehaves on purpose
(tools/harness/rogue_leader.py, the node's own joining and sending code): a forged plan, a replayed one, and a
rank 0 that hangs while the group loads. Each worker ends cleanly, exit 69 with one line naming why."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tools.harness.group import Follower, write_hostfile, write_secret


def rogue_group(model, home, mode: str, env: dict | None = None):
    hostfile = write_hostfile(home / "hosts.json", 2)
    secret = write_secret(home / "group-secret")
    env = {"PROVIDER_GROUP_SECRET_FILE": str(secret)} | (env or {})
    follower = Follower(model, home / "rank1", hostfile, 1, env=env)
    rogue = subprocess.Popen([sys.executable, "-m", "tools.harness.rogue_leader", str(hostfile), str(secret),
                              str(model), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=follower.env)
    return follower, rogue


@pytest.mark.heavy
@pytest.mark.parametrize("mode,why", [("forge", "not proven by the group's secret"),
                                      ("replay", "came out of order")])
def test_a_forged_or_replayed_plan_ends_the_worker_cleanly(fixtures_dir, tmp_path, mode, why):
    follower, rogue = rogue_group(fixtures_dir / "llama-tiny", tmp_path, mode)
    try:
        code = follower.proc.wait(120)
        said = follower.logs()
        assert code == 69, said[-3000:]
        assert why in said and "Traceback" not in said, said[-3000:]
        assert "rogue rank 0 sent its bad plan" in rogue.communicate(timeout=60)[0]
    finally:
        rogue.kill()
        follower.stop(signal.SIGKILL)


@pytest.mark.heavy
def test_a_rank_0_that_hangs_while_the_group_loads_is_not_waited_for(fixtures_dir, tmp_path):
    """Followers had no watchdog between joining and serving: a rank 0 that joined and then hung kept them in
    MLX's collective for ever. Now loading has its own limit (group_load_timeout_s)."""
    follower, rogue = rogue_group(fixtures_dir / "llama-tiny", tmp_path, "stall-after-join",
                                  env={"PROVIDER_GROUP_LOAD_TIMEOUT_S": "4"})
    try:
        start = time.monotonic()
        code = follower.proc.wait(120)
        said = follower.logs()
        assert code == 69, said[-3000:]
        assert "loading llama-tiny with rank 0 did not complete" in said and "Traceback" not in said, said[-3000:]
        assert time.monotonic() - start < 100
    finally:
        rogue.kill()
        follower.stop(signal.SIGKILL)
