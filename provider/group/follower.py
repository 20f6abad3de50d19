"""A rank other than 0: no session, no listener. It joins the group, loads its share of the model, then runs
rank 0's steps until rank 0 stops (exit 0) or the group is lost (exit EXIT_GROUP_LOST, for its supervisor to
restart it)."""

from __future__ import annotations

import os
import sys
import time

from .. import logs, systemd_notify
from ..jobs import JobError
from ..machine import decide_node_budget, node_step_tokens
from ..models.loader import load_pair
from ..prompts import PromptPreparer
from ..settings import Settings
from ..speculation import DrafterPlan
from ..status import EngineStats
from ..types import SpecReason
from ..engine.collective import GroupLost, collective_failure
from ..verification.verifier import read_claim
from .lockstep import FollowerRunning, follow
from .member import EXIT_GROUP_LOST, Watchdog, join_with_settings
from .spec import GroupSpec

log = logs.get("group")


class ServicePings:
    """systemd's watchdog fed from the step loop (an idle group steps once a second), at its own interval: a
    follower stuck in a collective stops the pings and its supervisor restarts it."""

    def __init__(self, status: str):
        self.status = status
        self.interval = systemd_notify.watchdog_interval()
        self._last = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if self.interval is not None and now - self._last >= self.interval:
            self._last = now
            systemd_notify.notify(f"WATCHDOG=1\nSTATUS={self.status}")


def run_follower(settings: Settings, spec: GroupSpec) -> int:
    def stalled(why: str) -> None:
        print(f"provider: rank {spec.rank}: {why}; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_GROUP_LOST)  # the loop is inside a collective (or a wait for rank 0) that will not return

    # Joining takes at most three timeouts (the rendezvous, MLX's init, the wake-up connections); past the
    # rendezvous every rank was alive, so the rest is quick unless one died or hangs. (MLX's init holds the
    # interpreter's lock: its own wait is bounded by faulthandler's timer, in link.join.)
    watchdog = Watchdog(3 * settings.group_timeout_s, stalled, "joining the group")
    watchdog.arm()
    try:
        joined = join_with_settings(settings, spec, decide_node_budget(settings), node_step_tokens(settings))
        member, model_id = joined.membership, joined.model_id
        print(f"provider: rank {spec.rank} of {spec.size} joined the group; loading {model_id}", flush=True)
        watchdog.expect(f"loading {model_id} with rank 0", settings.group_load_timeout_s)
        lm, _ = load_pair(model_id, joined.path, None, DrafterPlan(None, SpecReason.GROUP_MODE), member.link.group,
                          settings.group_split)
        lm.kv_quant = member.engine.kv_quant()  # rank 0's KV precision: the same caches on every rank
        prompts = PromptPreparer(joined.tokenizer_files, workers=1).tokenizer(model_id)
    except (GroupLost, JobError) as e:
        print(f"provider: rank {spec.rank} cannot serve: {getattr(e, 'message', e)}", file=sys.stderr, flush=True)
        return EXIT_GROUP_LOST if isinstance(e, GroupLost) else 1
    except Exception as e:
        if not collective_failure(e):
            raise
        print(f"provider: rank {spec.rank} lost the group while loading: {e}", file=sys.stderr, flush=True)
        return EXIT_GROUP_LOST
    running = FollowerRunning(member.link, stats=EngineStats(), step_tokens=member.engine.step_tokens,
                              max_rows=member.engine.max_rows, prefix_cache_bytes=0, read_claim=read_claim)
    watchdog.expect("a step of the group", settings.group_step_timeout_s)
    print(f"provider: rank {spec.rank} of {spec.size} serving {model_id} for rank 0", flush=True)
    status = f"rank {spec.rank} of {spec.size} serving {model_id} for rank 0"
    systemd_notify.notify(f"READY=1\nSTATUS={status}")
    pings = ServicePings(status)
    try:
        follow(member.link, running, lm, prompts.grammar, prompts.tool_format, lambda: (watchdog.beat(), pings.beat()))
    except Exception as e:
        if not collective_failure(e):
            log.exception("group_follower_failed")
        print(f"provider: rank {spec.rank} lost the group: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_GROUP_LOST
    log.info("group_stopped", rank=spec.rank)
    return 0
