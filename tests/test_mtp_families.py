"""Speculation with an MTP head shipped inside the target's checkpoint (issue 42), through the real engine.

The fixture is a tiny hybrid Qwen3.5 (Gated DeltaNet and full-attention layers) in Hugging Face's layout with
`mtp.*` head weights, built by the fixture factory and its head distilled briefly on its target's greedy
continuations of a few prompts (`fixtures_mtp.train_prompts`): on those its drafts are often accepted, elsewhere
seldom, so rounds accept every number of drafts from 0 to k. Greedy output must equal plain decoding."""

import asyncio
import itertools

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider.models import capability
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import drafter_footprint, head_kv_shape
from provider.types import SpecMode
from tests.helpers import collect, greedy, make_node, run
from provider.jobs import Job

NAME = "qwen3_5-mtp-tiny"


@pytest.fixture(scope="module")
def target(fixtures_dir):
    return fixtures_dir / NAME


def prompts(target) -> list[list[int]]:
    """Eight prompts: four the head was distilled on, four held out of 1 to 90 tokens (past the head's
    first read of a chunk, and one of a single token, which gives the head no prompt pair at all)."""
    _, tok = load(str(target))
    text = tok.encode("The provider node serves language models to a network of clients. " * 6)
    return train_prompts()[:4] + [text[:1], text[3:10], text[5:40], text[:90]]


def plain(target, prompt, n):
    model, _ = load(str(target))
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


def test_capability_is_read_from_config_and_head_tensors(target, tmp_path):
    config = capability.read_config(target)
    caps = capability.with_drafter(capability.detect(target, config), target, None, config)
    assert caps.native_mtp_heads and caps.native_mtp_declared == 1
    assert (caps.mtp_capable, caps.drafter_reason) == (True, "ok")
    # The key without the tensors (what mlx-community conversions ship) is not a head.
    import json
    import shutil

    from mlx.core import load as mx_load, save_safetensors

    stripped = tmp_path / "stripped"
    shutil.copytree(target, stripped)
    weights = {k: v for k, v in mx_load(str(stripped / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_safetensors(str(stripped / "model.safetensors"), weights)
    caps = capability.with_drafter(capability.detect(stripped, config), stripped, None, config)
    assert not caps.native_mtp_heads and not caps.mtp_capable and caps.drafter_reason == "not_mtp_capable"
    assert json.loads((stripped / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    # Booked as the head alone (its tensors and activations), and its own K/V per token per row.
    need = drafter_footprint(target, config, SpecMode.MTP, 3, 512)
    head_bytes = sum(v.nbytes for k, v in mx_load(str(target / "model.safetensors")).items() if k.startswith("mtp."))
    assert head_bytes < need < 4 * head_bytes + (64 << 20)
    assert head_kv_shape(target, config).bytes_per_token_full == 2 * 2 * 16 * 4  # K and V, 2 heads x 16, fp32


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    n = 24
    ps = prompts(target)
    truth = [plain(target, p, n) for p in ps]
    node = make_node({NAME: target}, max_concurrent_jobs=8, speculation="on", speculation_k=3)

    async def main():
        alone = [await collect(node, Job(f"a{i}", NAME, greedy(n), prompt_ids=tuple(p))) for i, p in enumerate(ps)]
        together = await asyncio.gather(*(collect(node, Job(f"t{i}", NAME, greedy(n), prompt_ids=tuple(p)))
                                          for i, p in enumerate(ps)))
        await node.stop()
        return alone, together

    alone, together = run(main())
    accepted = set()
    for kind, results in (("alone", alone), ("together", together)):
        for i, (ids, _, done, _) in enumerate(results):
            spec = done.telemetry.speculation
            assert (spec.mode.value, spec.reason) == ("mtp", "ok"), (kind, i, spec)
            assert ids == truth[i], f"{kind} job {i} ({len(ps[i])} prompt tokens)"
            accepted.add(spec.accepted)
    trained = [r[2].telemetry.speculation for r in alone[:4]]
    # The distilled prompts: the head's first draft is accepted most rounds (real acceptance, not a stand-in).
    assert sum(s.accepted for s in trained) / sum(s.rounds for s in trained) > 0.5
    assert together[0][2].telemetry.speculation.mean_batch > 2  # verified together with the others
    assert len(accepted) > 2
