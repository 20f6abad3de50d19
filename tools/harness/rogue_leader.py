"""A rank 0 that misbehaves on purpose, built from the node's own parts, for the tests and the fuzz campaign:
it joins a group of real worker ranks exactly as `provider start --group ... --rank 0` does, then

- `forge`: sends one good plan, then a plan sealed under another secret (what a stranger on the ring sends);
- `replay`: sends one good plan, then the same sealed bytes again (what an on-path attacker replays);
- `stall-after-join`: joins and never loads (a rank 0 that hangs while the group loads).

    python -m tools.harness.rogue_leader HOSTFILE SECRET_FILE MODEL MODE

Every worker must end cleanly (exit 69, one line naming why), never run what it was sent.
"""

from __future__ import annotations

import secrets
import sys
import time

from provider.group.link import seal
from provider.group.lockstep import check_step
from provider.group.member import join_with_settings
from provider.group.plan import StepPlan, encode_plan
from provider.group.secret import GroupKey
from provider.group.spec import group_spec
from provider.machine import decide_node_budget, node_step_tokens
from provider.models.loader import load_pair
from provider.settings import Settings
from provider.speculation import DrafterPlan
from provider.types import SpecReason

MODES = ("forge", "replay", "stall-after-join")


def main(argv: list[str]) -> int:
    hostfile, secret_file, model, mode = argv
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}")
    settings = Settings.load(cli={"model": model})
    spec = group_spec(hostfile, 0, "ring", {}, secret_file)
    joined = join_with_settings(settings, spec, decide_node_budget(settings), node_step_tokens(settings))
    link = joined.membership.link
    print(f"rogue rank 0 joined; mode {mode}", flush=True)
    if mode == "stall-after-join":
        time.sleep(3600)
        return 0
    load_pair(joined.model_id, joined.path, None, DrafterPlan(None, SpecReason.GROUP_MODE), link.group,
              settings.group_split)
    good = seal(spec.key, link.messages, "plan", encode_plan(StepPlan()))
    send(link, good)
    check_step(link, [])  # the worker ran the empty step and checks it with rank 0
    if mode == "forge":
        stranger = GroupKey(secrets.token_bytes(32), spec.hosts)
        send(link, seal(stranger, link.messages, "plan", encode_plan(StepPlan())))
    else:
        send(link, good)
    print("rogue rank 0 sent its bad plan", flush=True)
    time.sleep(5)  # the worker ends on its own; rank 0 leaves after
    return 0


def send(link, sealed: bytes) -> None:
    """Bytes as rank 0's next plan: the worker woken, then the bytes through the group's collective."""
    link.doorbell.ring()
    link.messages += 1
    link.transfer(sealed, "plan")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
