"""Speculation with GLM-4.7-Flash's nextn (MTP) layer shipped inside its checkpoint (issue 42), through the real engine.

The fixture is a tiny glm4_moe_lite (MLA attention, MoE with a shared expert) in the published layout with its nextn
layer as `model.layers.<num_hidden_layers>.*`, built by the fixture factory; its head is untrained, so greedy drafts
are seldom accepted (the Qwen3.5 fixture covers real acceptance), and sampled rounds at T = 0.7 accept ~9% of drafts
and resample the rest. Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.jobs import SamplingParams
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.kind import KIND as NATIVE_HEAD
from provider.drafters.mtp.glm4_moe_lite import load_head
from tests import mtp_checks

NAME = "glm4_moe_lite-mtp-tiny"
NEXTN = "model.layers.3."  # num_hidden_layers = 3


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_nextn_tensors(target, tmp_path):
    # The key without the tensors (what mlx-community conversions ship: sanitize dropped them) is not a head.
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(NEXTN))
    assert json.loads((tmp_path / "stripped" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # Booked as the nextn layer's tensors (its own embedding and LM head among them) plus activations, and its
    # per-token cache as MLA holds it: the normed latent (kv_lora_rank 32) and the rotated k_pe (8), fp32.
    on_disk = mx.load(str(target / "model.safetensors"))
    head_bytes = sum(v.nbytes for k, v in on_disk.items() if k.startswith(NEXTN))
    need = NATIVE_HEAD.footprint(target, config, 3, 512)
    from provider.memory import estimate

    assert need - head_bytes == estimate.activation_bytes(config, 512)
    assert NATIVE_HEAD.kv_shape(target, config).bytes_per_token_full == (32 + 8) * 4
    model, _ = load(str(target))
    head = load_head(target, model)
    assert sum(v.nbytes for _, v in tree_flatten(head.parameters())) == head_bytes  # what it really holds
    mtp_checks.cache_holds(head, (32 + 8) * 4)
    assert estimate.weight_bytes(config, open_tensors(target)) == \
        sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # the target's books hold no head


def open_tensors(path):
    from provider.memory.checkpoint import open_checkpoint

    return open_checkpoint(path).tensors


def test_a_misshaped_head_is_refused_at_load_and_the_target_still_served(target, tmp_path):
    """eh_proj cut to [64, 127]: the header says a head is there (capability holds), the load refuses it cleanly,
    and the node decodes plain with the reason (auto), the output as plain decoding's."""
    bad = mtp_checks.rewritten(target, tmp_path / "bad",
                               lambda w: w | {NEXTN + "eh_proj.weight": w[NEXTN + "eh_proj.weight"][:, :127]})
    mtp_checks.refused_and_served_plain(bad, target, NAME, load_head)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    _greedy_alone_and_together(target, NAME)


def test_deepseek_v3_greedy_with_its_nextn_head_equals_plain_decoding_alone_and_eight_together(head_fixture):
    """DeepSeek-V3's nextn layer, the same layout on mlx-lm's deepseek_v3 classes (no mlx-vlm drafter to compare
    with: greedy equality only)."""
    _greedy_alone_and_together(head_fixture("deepseek_v3-mtp-tiny"), "deepseek_v3-mtp-tiny")


def _greedy_alone_and_together(target, name: str) -> None:
    mtp_checks.greedy_as_plain(target, name)


def _mlx_vlm_reference(target):
    """mlx-vlm's side. mlx-vlm 0.7.10 ships GLM-4.7-Flash's splitter and config but no runtime drafter
    (`load_drafter` fails: its glm4_moe_lite_mtp package has no Model), so the reference is assembled from mlx-vlm's
    own parts: its split of the checkpoint (Glm4MoeLiteMTPSplitter.prepare: its weights, bfloat16), its
    glm4_moe_lite decoder layer, its AutoregressiveMTPDraftModel session (prefill, draft_block) and the step of
    its GLM nextn drafters (glm_moe_dsa_mtp, glm5_next_mtp): eh_proj(concat[enorm(e), hnorm(h)]) -> the layer ->
    shared_head_norm, that hidden both fed back and read by the LM head (here the split's own lm_head and
    embed_tokens, which the split keeps)."""
    from mlx import nn
    from mlx_vlm.models.base import create_attention_mask
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.models.glm4_moe_lite.config import ModelConfig
    from mlx_vlm.models.glm4_moe_lite.language import Glm4MoeLiteDecoderLayer
    from mlx_vlm.speculative.drafters.glm4_moe_lite_mtp.split import (
        Glm4MoeLiteMTPSplitter,
    )
    from mlx_vlm.speculative.drafters.mtp_base import AutoregressiveMTPDraftModel

    config, weights = Glm4MoeLiteMTPSplitter().prepare(target)
    # bfloat16 as split; the fixture's values are bfloat16's, so float32 again losslessly (MLX's CPU expert matmul
    # takes float32 only)
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    tc = ModelConfig.from_dict(config["text_config"])

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            h = tc.hidden_size
            self.embed_tokens = nn.Embedding(tc.vocab_size, h)
            self.enorm, self.hnorm = nn.RMSNorm(h, eps=tc.rms_norm_eps), nn.RMSNorm(h, eps=tc.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.mtp_block = Glm4MoeLiteDecoderLayer(tc, tc.num_hidden_layers)
            self.shared_head_norm = nn.RMSNorm(h, eps=tc.rms_norm_eps)

    class Reference(AutoregressiveMTPDraftModel):
        def __init__(self):
            super().__init__(config)
            self.model = Inner()
            self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)

        def make_cache(self):
            return [KVCache()]

        def bind(self, target_model):
            super().bind(target_model)
            self._input_embed, self._lm_head_fn = self.model.embed_tokens, self.lm_head
            return self

        def _forward_hidden(self, token_embed, hidden, tokens, cache):
            m, c = self.model, cache[0]
            x = m.eh_proj(mx.concatenate([m.enorm(token_embed), m.hnorm(hidden)], axis=-1))
            x = m.mtp_block(x, create_attention_mask(x, c, return_array=True) if x.shape[1] > 1 else None, c)
            h = m.shared_head_norm(x)
            return h, h

    reference = Reference()
    reference.load_weights(list(weights.items()), strict=True)
    return reference, weights


def _their_name(name: str) -> str:
    name = name.replace("block.", "model.mtp_block.", 1) if name.startswith("block.") else name
    name = {"shared_head.norm.weight": "model.shared_head_norm.weight", "shared_head.head.weight": "lm_head.weight"
            }.get(name, name)
    return name if name.startswith(("model.", "lm_head")) else "model." + name


def test_the_head_computes_what_mlx_vlms_glm_drafter_parts_compute_on_the_same_weights(target):
    """The head as loaded here against the mlx-vlm reference above: the same parameters bit for bit (mlx-vlm's
    split of kv_b_proj and of the experts = mlx-lm's sanitize), the router's correction bias float32 on both; on
    the prompt's pairs then four draft steps the same hidden states, draft tokens and cached latents."""
    pytest.importorskip("mlx_vlm.speculative.drafters.glm4_moe_lite_mtp.split")
    theirs, weights = _mlx_vlm_reference(target)
    model, tap, ours = mtp_checks.loaded(target, load_head)
    mtp_checks.same_parameters({_their_name(k): v for k, v in tree_flatten(ours.parameters())}, weights)
    ids, cache = mtp_checks.drafts_as_mlx_vlms(target, model, tap, ours, theirs, ours.embed_tokens,
                                               lambda h: ours.lm_head(ours.readout(h)))
    assert cache[0].offset == ids.shape[1] + 3

    # The node's own drafting (HeadDrafter in the engine's round loop, the head's embed_tokens, its pairs read
    # chunk by chunk) proposes the reference's drafts for the same prompt and first token.
    from provider.engine.proposers import HeadDrafter
    from provider.engine.spec_rounds import Speculator
    from provider.models.gemma4_target import Target
    from provider.telemetry import SpecTelemetry

    spec = Speculator(model, HeadDrafter(ours, Target(model)))
    row = spec.new_row(ids[0].tolist(), stats=SpecTelemetry("mtp", k=4))
    while not spec.read(row, 8):  # in chunks of 8, as a long prompt is read
        pass
    first = spec.begin([row])[0]
    drafts, _ = spec.drafter.propose([row], 4, row.caches)
    theirs.reset(model)
    model(ids)
    theirs.prefill_from_target_hidden(ids, tap.last, first, None, greedy=True)
    assert drafts.tolist() == theirs.draft_block(first, None, None, 5, None, greedy=True).tolist()


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params)
