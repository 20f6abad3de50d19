"""Speculation in a node group (issue 42): the drafter on rank 0 alone, every rank verifying its drafts. A group
of two on loopback (the documented commands, MLX's ring, mlx-lm's `sharded_load` split by projections) with the
node's policy `on`: a native MTP head (Qwen3.5's, inside the checkpoint) and a draft model (Llama's). Their
outputs equal the same group's plain decoding (the request's `speculation: off`), greedy, seeded-sampled and under
a JSON schema, 8 at once, while drafts are accepted; the ranks' per-step token check passes throughout (a
disagreement would stop the group). Rank 0's drafts reach the other ranks checked: a round that does not fit is
the group's end, never an out-of-range id in a forward."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from provider.engine.collective import GroupLost
from provider.group.drafts import drafts_of
from provider.speculation import DrafterPlan, plan_group_drafter
from provider.types import Policy, SpecMode, SpecReason
from tests import mtp_checks
from tools.harness.group import start_group

PROMPTS = ["The cache", "Once upon a time", "def main():", "A B C D", "hello hello", "Numbers: 1 2 3",
           "The quick brown fox", "Why is the sky"]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"], "additionalProperties": False}}}


def complete(srv, prompt: str | list[int], speculation: str, **kw) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=300,
                   json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "speculation": speculation} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, prompt: str, speculation: str) -> dict:
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, timeout=300,
                   json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
                         "response_format": SCHEMA, "speculation": speculation})
    assert r.status_code == 200, r.text
    return r.json()


def texts_and_specs(pool, call, speculation: str, prompts: list) -> tuple[list[str], list[dict]]:
    got = list(pool.map(lambda p: call(p, speculation), prompts))
    texts = [g["choices"][0].get("text") or g["choices"][0]["message"]["content"] for g in got]
    return texts, [g["telemetry"]["speculation"] for g in got]


@pytest.mark.heavy
@pytest.mark.parametrize("target,drafter,mode", [("qwen3_5-mtp-tiny", None, "mtp"),
                                                 ("llama-tiny", "llama-tiny-draft", "draft")])
def test_a_group_drafts_on_rank_0_and_every_rank_verifies_exactly(fixtures_dir, head_fixture, tmp_path, target,
                                                                  drafter, mode):
    model = head_fixture(target) if drafter is None else fixtures_dir / target
    extra = ("--speculation", "on") + (("--drafter", str(fixtures_dir / drafter)) if drafter else ())
    leader, followers = start_group(model, tmp_path, 2, "--group-split", "tensor", *extra)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once: one round over them all
            calls = {"greedy": lambda p, s: complete(leader, p, s),
                     "seeded": lambda p, s: complete(leader, p, s, temperature=0.9, top_p=0.95, seed=7),
                     "schema": lambda p, s: chat(leader, p, s)}
            for kind, call in calls.items():
                # The head's: four prompts it was distilled on (so its drafts are kept), four held out.
                prompts = PROMPTS if drafter or kind == "schema" else mtp_checks.prompts(model)
                plain, off = texts_and_specs(pool, call, "off", prompts)
                spec, on = texts_and_specs(pool, call, "on", prompts)
                assert all(s["mode"] == "off" for s in off) and all(s["mode"] == mode for s in on), (kind, on)
                assert spec == plain, kind
                if kind == "greedy" and not drafter:  # drafts were made on rank 0 and kept by every rank
                    assert sum(s["accepted"] for s in on) > 0, on
        assert all(f.proc.poll() is None for f in followers)  # no rank saw another token than rank 0's
        health = httpx.get(f"{leader.url}/health").json()
        assert health["group"]["ranks"] == 2
    finally:
        assert leader.stop() == 0, leader.logs()[-3000:]
        for f in followers:
            assert f.proc.wait(30) == 0, f.logs()[-3000:]
            f.stop()


def test_rank_0s_drafts_that_fit_this_ranks_round_are_taken():
    assert drafts_of({"k": 3, "drafts": [[1, 2, 3], [4, 5, 511]]}, 2, 3, 512) == [[1, 2, 3], [4, 5, 511]]


@pytest.mark.parametrize("body", [
    {"k": 2, "drafts": [[1, 2, 3], [4, 5, 6]]},  # another k
    {"k": 3, "drafts": [[1, 2, 3]]},  # a row missing
    {"k": 3, "drafts": [[1, 2, 3], [4, 5, 600]]},  # an id past the vocabulary
    {"k": 3, "drafts": [[1, 2, 3], [4, 5, -1]]},
    {"k": 3, "drafts": [[1, 2, 3], [4, 5, True]]},  # a bool is not an id
    {"k": 3, "drafts": [[1, 2, 3], [4, 5, 6.0]]},
    {"k": True, "drafts": [[1, 2, 3], [4, 5, 6]]},
    {"k": 3, "drafts": [[1, 2, 3], [4, 5, 6]], "more": 1},
    {"k": 3},
    [],
])
def test_rank_0s_drafts_that_do_not_fit_this_ranks_round_end_the_group(body):
    with pytest.raises(GroupLost, match="do not fit this rank's round"):
        drafts_of(body, 2, 3, 512)


def test_a_group_drafts_only_with_a_drafter_that_reads_tokens_and_the_final_hidden_and_policy_on():
    head = DrafterPlan(SpecMode.MTP, SpecReason.OK)
    assert plan_group_drafter(head, Policy.ON, True) == head
    assert plan_group_drafter(head, Policy.AUTO, True) == DrafterPlan(None, SpecReason.GROUP_MODE)  # unmeasured
    assert plan_group_drafter(head, Policy.ON, False) == DrafterPlan(None, SpecReason.GROUP_MODE)  # reads K/V
    none = DrafterPlan(None, SpecReason.NO_DRAFTER)
    assert plan_group_drafter(none, Policy.ON, True) == none


def test_rank_0s_whole_lm_head_is_the_checkpoints_own_or_refused(fixtures_dir, head_fixture, tmp_path):
    """The head a split target's drafter reads: the checkpoint's LM head, whole and as stored; a checkpoint whose
    LM head is not the whole of the split one is refused (the drafter is then not loaded: the target serves
    plain). A one-rank group splits nothing, and the split layer's class is what says it was split."""
    import shutil

    import mlx.core as mx
    from mlx.nn.layers.distributed import shard_linear

    from provider.models.loader import load
    from provider.drafters.mtp.split_lm_head import booked_bytes, held_bytes, whole_lm_head

    path = head_fixture("qwen3_5-mtp-tiny")
    lm = load("t", path)
    text = lm.model.language_model
    assert whole_lm_head(path, lm.model) is None  # not split: rank 0 holds it whole already
    whole = text.lm_head.weight
    text.lm_head = shard_linear(text.lm_head, "all-to-sharded", group=mx.distributed.init())
    head = whole_lm_head(path, lm.model)
    assert mx.array_equal(head.weight, whole) and held_bytes(head) == whole.nbytes
    assert booked_bytes(path, lm.config, 2) == whole.nbytes and booked_bytes(path, lm.config, 1) == 0
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    weights = {}
    for f in bad.glob("*.safetensors"):
        weights |= mx.load(str(f))
        f.unlink()
    name = next(n for n in weights if n.endswith("lm_head.weight") and "mtp" not in n)
    weights[name] = weights[name][:-1]
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="not the whole of the split one"):
        whole_lm_head(bad, lm.model)
