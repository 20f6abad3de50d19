"""Speculation with the MTP heads of Qwen3.5's MoE relatives (issue 42): Qwen3.5-MoE and Qwen3-Next, whose `mtp.*`
head's decoder layer carries a MoE MLP (experts and a gated shared expert), through the real engine.

The fixtures (fixtures.mtp_moe) are tiny hybrid targets (Gated DeltaNet and full attention, MoE MLPs) in the
published layout, the head's experts one tensor per expert, and each head distilled briefly on its target's greedy
continuations of `fixtures.mtp.train_prompts`. What tests/test_mtp_families.py checks for dense Qwen3.5, here for
both families: greedy output equals plain decoding, the head is mlx-vlm's on the same weights, sampling is exact."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.engine import recurrent
from provider.jobs import SamplingParams
from provider.models import capability
from tools.fixtures.mtp import HF_METADATA, train_prompts
from provider.drafters.mtp.kind import KIND as NATIVE_HEAD
from provider.drafters.mtp.qwen3_5 import load_head
from tests import mtp_checks
from tests.helpers import make_node, run
from tools.harness.isolated import run_isolated

NAMES = ("qwen3_5_moe-mtp-tiny", "qwen3_next-mtp-tiny")


@pytest.fixture(scope="module", params=NAMES)
def target(request, head_fixture):
    return head_fixture(request.param)


def _tensors(path) -> dict:
    return dict(mx.load(str(path / "model.safetensors")))


def test_capability_and_books_from_config_and_head_tensors(target, tmp_path):
    """The head is found from the config's `mtp_num_hidden_layers` and its `mtp.*` tensors (the key alone is not a
    head); the target's weight estimate is what mlx-lm holds (the head's experts are not the target's), the
    drafter's footprint books the head's bytes as loaded (its experts stacked) and its own K/V per token as the
    head's cache holds it."""
    config = capability.read_config(target)
    assert mtp_checks.head_found(target, config).speculates_with == NATIVE_HEAD.name
    stripped = tmp_path / "stripped"
    shutil.copytree(target, stripped)
    mx.save_safetensors(str(stripped / "model.safetensors"),
                        {k: v for k, v in _tensors(target).items() if not k.startswith("mtp.")}, metadata=HF_METADATA)
    mtp_checks.no_head_found(stripped, config)
    _, head = mtp_checks.booked_once(target, config, load_head)
    assert NATIVE_HEAD.kv_shape(target, config).bytes_per_token_full == 2 * 2 * 16 * 4
    mtp_checks.cache_holds(head, 2 * 2 * 16 * 4, pairs=7, width=head.fc.weight.shape[0])


def test_the_hybrid_rollback_finds_the_targets_gated_deltanet_mixers(target, monkeypatch):
    """recurrent.py rewinds the target's recurrent layers after a verify: it finds every Gated DeltaNet mixer
    (`linear_attn`, Qwen3-Next's own class too), and a row keeping 2 of 5 verified positions gets the state plain
    decoding of those 2 reaches, bit for bit: in a process of its own on MLX's reference BLAS, which rounds a
    projection alike at widths 5 and 2."""
    monkeypatch.setenv("TESTS_BLAS", "reference")  # widths 5 and 2 rounded alike: tools/harness/blas.py
    run_isolated(_hybrid_rollback, str(target))


def _hybrid_rollback(target: str) -> None:
    target = Path(target)
    model, _ = load(str(target))
    linear = [i for i, layer in enumerate(model.layers) if layer.is_linear]
    assert [i for i, _ in recurrent._mixers(model)] == linear and len(linear) == 2
    assert recurrent.install(model)
    prompt, verify = mx.array([train_prompts()[0]]), mx.array([[5, 17, 99, 3, 250]])
    caches, ref = model.make_cache(), model.make_cache()
    model(prompt, cache=caches)
    rewind = recurrent.begin(model, caches)
    model(verify, cache=caches)
    rewind.done()
    rewind.row(caches, 0, 2, 5)
    model(prompt, cache=ref)
    model(verify[:, :2], cache=ref)
    for i in linear:
        for a, b in zip(caches[i].cache, ref[i].cache):
            assert mx.array_equal(a, b).item(), i


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    name, n, ps = target.name, 24, mtp_checks.prompts(target)
    want = [mtp_checks.plain(target, p, n) for p in ps]
    alone, together, _ = mtp_checks.greedy_alone_and_together(target, name, ps, want, n)
    trained = [r[2].telemetry.speculation for r in alone[:4]]
    assert sum(s.accepted for s in trained) / sum(s.rounds for s in trained) > 0.5  # real acceptance
    assert together[0][2].telemetry.speculation.mean_batch > 2
    assert len({r[2].telemetry.speculation.accepted for r in alone + together}) > 2


def test_the_head_computes_what_mlx_vlms_drafter_computes_on_the_same_weights(target):
    """Ours (mlx-lm's layers, mlx-lm's sanitize of the experts) against mlx-vlm's Qwen3_5MTPDraftModel as its
    `load_drafter(kind="mtp")` loads the same checkpoint (its own split and expert stacking, its Qwen3.5-MoE layer
    for both families): the same parameters, and on the prompt's pairs then four draft steps the same hidden state
    and draft tokens bit for bit, and the same K/V: V bit for bit, K within 1e-6 (mlx-lm rotates with mx.fast.rope,
    mlx-vlm with its own M-RoPE arithmetic: 2e-9 apart on Qwen3-Next's here)."""
    pytest.importorskip("mlx_vlm.speculative.drafters.qwen3_5_mtp")
    from mlx_vlm.speculative.drafters import load_drafter

    theirs, kind = load_drafter(str(target), kind="mtp")
    assert kind == "mtp" and type(theirs).__name__ == "Qwen3_5MTPDraftModel"
    model, tap, ours = mtp_checks.loaded(target, load_head)
    mine, other = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert any(".switch_mlp." in k for k in mine)
    mtp_checks.same_parameters(mine, other)
    lm = getattr(model, "language_model", model)
    mtp_checks.drafts_as_mlx_vlms(target, model, tap, ours, theirs, lm.model.embed_tokens, lm.lm_head, k_tol=1e-6)


def test_experts_fused_or_per_expert_load_the_same_head_and_a_broken_one_is_refused(target, tmp_path):
    """A head's experts shipped fused (`experts.gate_up_proj` / `experts.down_proj`, the Qwen3.5-MoE target's own
    layout, converted by its sanitize) load the same parameters as one tensor per expert; a head missing an
    expert, or with one misshaped, fails its load (which the node's loader turns into no drafter)."""
    model, _ = load(str(target))
    want = dict(tree_flatten(load_head(target, model).parameters()))
    tensors = _tensors(target)
    head_experts = sorted({k.split(".experts.")[0] for k in tensors if k.startswith("mtp.") and ".experts." in k})
    if target.name.startswith("qwen3_5_moe"):
        fused = dict(tensors)
        for base in head_experts:
            gate, up, down = ([fused.pop(f"{base}.experts.{e}.{p}_proj.weight") for e in range(4)]
                              for p in ("gate", "up", "down"))
            fused[f"{base}.experts.gate_up_proj"] = mx.concatenate([mx.stack(gate), mx.stack(up)], axis=-2)
            fused[f"{base}.experts.down_proj"] = mx.stack(down)
        shutil.copytree(target, tmp_path / "fused")
        mx.save_safetensors(str(tmp_path / "fused" / "model.safetensors"), fused, metadata=HF_METADATA)
        got = dict(tree_flatten(load_head(tmp_path / "fused", model).parameters()))
        assert got.keys() == want.keys()
        assert [k for k in got if not mx.array_equal(got[k], want[k]).item()] == []
    expert = f"{head_experts[0]}.experts.3.up_proj.weight"
    for case, broken in (("missing", {k: v for k, v in tensors.items() if k != expert}),
                         ("misshaped", tensors | {expert: tensors[expert][:, :-1]}),
                         ("misshaped fc", tensors | {"mtp.fc.weight": tensors["mtp.fc.weight"][:, :-1]})):
        shutil.copytree(target, tmp_path / case)
        mx.save_safetensors(str(tmp_path / case / "model.safetensors"), broken, metadata=HF_METADATA)
        with pytest.raises((KeyError, ValueError)):
            load_head(tmp_path / case, model)


def test_sampled_rounds_with_the_moe_head_draw_through_the_shared_rule(head_fixture):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    # train_prompts()[1]: the head's drafts accepted ~11% of the time there ([0]: ~5%)
    mtp_checks.draws_through_the_shared_rule(head_fixture(NAMES[0]), load_head, train_prompts()[1], params)


def test_the_node_lists_both_as_speculating_with_their_own_head(head_fixture):
    from coordinator_client.registration import model_infos

    node = make_node({n: head_fixture(n) for n in NAMES})
    caps = {i.id: i.capabilities for i in model_infos(node.status())}
    run(node.stop())
    for name in NAMES:
        assert (caps[name].mtp_capable, caps[name].native_mtp_heads, caps[name].speculates_with) == \
            (True, True, "own_mtp_head"), name
    assert json.loads((head_fixture(NAMES[1]) / "config.json").read_text())["model_type"] == "qwen3_next"
