"""The node's decisions are pure functions over plain data: no MLX, no files, no network."""

import subprocess
import sys
from dataclasses import replace

import pytest

from provider.models.capability import Capabilities
from provider.speculation import DrafterPlan, plan_drafter
from provider.types import Policy, SpecMode

GEMMA = Capabilities(family="gemma4", quantization=None, context_length=8192, sliding_window=512,
                     kv_shared_layers=2, vision=False, is_drafter=False, native_mtp_heads=False,
                     native_mtp_declared=0)
PAIRED = replace(GEMMA, mtp_capable=True, drafter_reason="ok")
DRAFT = replace(GEMMA, family="llama", draft_compatible=True, drafter_reason="ok")
MiB = 1 << 20


def test_a_target_that_cannot_use_a_drafter_is_not_mtp_capable_whatever_else_holds():
    llama = replace(GEMMA, family="llama", drafter_reason="not_mtp_capable")
    for policy in Policy:
        assert plan_drafter(llama, policy, 0, 10 * MiB) == DrafterPlan(None, "not_mtp_capable")


def test_a_gemma4_with_no_paired_assistant_has_no_drafter():
    assert plan_drafter(replace(GEMMA, drafter_reason="no_drafter"), Policy.AUTO, 0, MiB).reason == "no_drafter"
    # Named but not pairing (the pairing problem is logged, the stable reason is no_drafter).
    unpaired = replace(GEMMA, drafter_reason="backbone_hidden_size 256 != target hidden_size 1536")
    assert plan_drafter(unpaired, Policy.AUTO, 0, MiB) == DrafterPlan(None, "no_drafter")


def test_capability_is_checked_before_headroom():
    assert plan_drafter(replace(GEMMA, drafter_reason="no_drafter"), Policy.AUTO, 10 * MiB, 0).reason == "no_drafter"


def test_headroom_is_checked_before_policy():
    assert plan_drafter(PAIRED, Policy.OFF, 2 * MiB, MiB) == DrafterPlan(None, "insufficient_headroom")
    assert plan_drafter(PAIRED, Policy.AUTO, MiB + 1, MiB).reason == "insufficient_headroom"


def test_policy_off_when_everything_else_holds():
    assert plan_drafter(PAIRED, Policy.OFF, MiB, MiB) == DrafterPlan(None, "policy_off")


@pytest.mark.parametrize("caps, mode", [(PAIRED, SpecMode.MTP), (DRAFT, SpecMode.DRAFT)])
@pytest.mark.parametrize("policy", [Policy.AUTO, Policy.ON])
def test_a_drafter_when_all_hold(caps, mode, policy):
    assert plan_drafter(caps, policy, MiB, MiB) == DrafterPlan(mode, "ok")


def test_the_decision_modules_import_no_mlx():
    code = ("import sys; import provider.speculation, provider.models.capability, provider.memory.admission, "
            "coordinator_client.backoff; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'grpc')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
