"""The MLX Gemma 4 assistant against transformers' reference, on the same random weights (fp32).

transformers (torch CPU) is the oracle: a tiny Gemma4ForCausalLM target and Gemma4AssistantForCausalLM are
built there, saved as Hugging Face checkpoints, and loaded here with the node's own loaders. Needs the
`parity` extra (torch); skipped without it.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mlx_lm import load  # noqa: E402

from provider.engine.acceptance import GreedyChoice, greedy_tokens  # noqa: E402
from provider.engine.proposers import MTPDrafter  # noqa: E402
from provider.engine.spec_rounds import SpecRow, speculative_tokens  # noqa: E402
from provider.telemetry import SpecTelemetry
from provider.models.gemma4_target import Target
from provider.models import capability  # noqa: E402
from provider.drafters.gemma4_assistant import load_assistant  # noqa: E402

WINDOW = 32
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}


def _text_config(**kw):
    from transformers import Gemma4TextConfig

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, global_head_dim=32, num_kv_shared_layers=2,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, sliding_window=WINDOW,
                layer_types=LAYER_TYPES, max_position_embeddings=1024, final_logit_softcapping=30.0,
                use_double_wide_mlp=True, tie_word_embeddings=True, rope_parameters=ROPE, rms_norm_eps=1e-6,
                attention_k_eq_v=False, enable_moe_block=False)
    return Gemma4TextConfig(**(base | kw))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, monkeypatch_module, fixtures_dir):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    # transformers raises for a config whose every layer is KV-shared (the assistant's); it means "all reuse".
    original = Gemma4TextConfig.kv_sharing_modes

    def kv_sharing_modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    monkeypatch_module.setattr(Gemma4TextConfig, "kv_sharing_modes", property(kv_sharing_modes))
    root = tmp_path_factory.mktemp("parity")
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(_text_config()).float().eval()
    with torch.no_grad():  # the default init is tiny; widen it so logits are far from ties
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    target.save_pretrained(root / "target")
    _as_published(root / "target")

    acfg = Gemma4AssistantConfig(
        backbone_hidden_size=64, num_centroids=16, centroid_intermediate_top_k=4, use_ordered_embeddings=True,
        tie_word_embeddings=True,
        text_config=_text_config(hidden_size=32, num_hidden_layers=2, layer_types=LAYER_TYPES[1:3],
                                 num_kv_shared_layers=2, hidden_size_per_layer_input=0,
                                 vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                                 final_logit_softcapping=None).to_dict())
    assistant = Gemma4AssistantForCausalLM(acfg).float().eval()
    with torch.no_grad():
        for p in assistant.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(512))
    assistant.generation_config.num_assistant_tokens = 4
    assistant.save_pretrained(root / "assistant")
    _as_published(root / "assistant")
    for d in ("target", "assistant"):  # a 512-token tokenizer for mlx-lm's loader and the pairing check
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / d / name).write_bytes((fixtures_dir / "gemma4-tiny" / name).read_bytes())
    return target, assistant, root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _as_published(checkpoint) -> None:
    """transformers 5.23 saves the full layers' head size as per_layer_config; published Gemma 4 configs
    (and mlx-lm) use the flat `global_head_dim` key. Write it the published way."""
    import json

    path = checkpoint / "config.json"
    cfg = json.loads(path.read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        per_layer = c.get("per_layer_config") or {}
        dims = {v["head_dim"] for v in per_layer.values() if "head_dim" in v}
        if dims:
            c["global_head_dim"] = dims.pop()
    path.write_text(json.dumps(cfg, indent=2))


def _np(x) -> np.ndarray:
    return np.array(x.detach().float().numpy() if hasattr(x, "detach") else x, dtype=np.float32)


PROMPT = [5, 17, 99, 3, 250, 7, 42, 300, 11, 12, 13, 480, 64, 8, 200, 150, 90, 33, 21]  # shorter than the window


def test_checkpoints_load_and_pair(pair):
    _, _, root = pair
    assert capability.pair_assistant(root / "target", root / "assistant").paired


def test_target_hidden_and_shared_kv_match_transformers(pair):
    target_hf, _, root = pair
    with torch.no_grad():
        out = target_hf(torch.tensor([PROMPT]), return_shared_kv_states=True, output_hidden_states=True)
    model, _ = load(str(root / "target"))
    target = Target(model)
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=caches)
    logits, hidden = target.forward(mx.array(PROMPT[-1:])[None], caches)
    np.testing.assert_allclose(_np(hidden[0, -1]), _np(out.hidden_states[-1][0, -1]), atol=1e-4)
    np.testing.assert_allclose(_np(logits[0, -1]), _np(out.logits[0, -1]), atol=1e-4)
    ours, _ = target.shared_kv(caches)
    for kind, (k, v) in out.shared_kv_states.items():
        np.testing.assert_allclose(_np(ours[kind][0]), _np(k), atol=1e-4, err_msg=f"{kind} K")
        np.testing.assert_allclose(_np(ours[kind][1]), _np(v), atol=1e-4, err_msg=f"{kind} V")


def test_draft_tokens_and_logits_match_transformers(pair):
    target_hf, assistant_hf, root = pair
    k = 4
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = target_hf(ids, return_shared_kv_states=True, output_hidden_states=True)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        # As transformers' Gemma 4 assistant candidate generator does after the prefill.
        input_ids = torch.cat([ids, first], dim=1)
        kv = {t: (a[:, :, : input_ids.shape[1]], b[:, :, : input_ids.shape[1]])
              for t, (a, b) in out.shared_kv_states.items()}
        h, tok = out.hidden_states[-1][:, -1:], input_ids[:, -1:]
        position = torch.tensor([[input_ids.shape[1] - 1]])
        hf_logits, hf_tokens = [], []
        for _ in range(k):
            emb = target_hf.get_input_embeddings()(tok)
            step = assistant_hf(inputs_embeds=torch.cat([emb, h], dim=-1), position_ids=position,
                                shared_kv_states=kv, attention_mask=torch.ones_like(input_ids), use_cache=False)
            tok, h = step.logits.argmax(-1), step.last_hidden_state
            hf_logits.append(_np(step.logits[0, -1]))
            hf_tokens.append(int(tok))

    model, _ = load(str(root / "target"))
    target, assistant = Target(model), load_assistant(root / "assistant")
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=caches)
    logits, hidden = target.forward(mx.array(PROMPT[-1:])[None], caches)
    assert greedy_tokens(logits[:, -1]).item() == int(first)
    shared, _ = target.shared_kv(caches)
    token, h_mx = mx.array([int(first)]), hidden[:, -1:]
    for i in range(k):
        step_logits, h_mx = assistant.step(target.scaled_embedding(token)[None], h_mx, shared, len(PROMPT))
        np.testing.assert_allclose(_np(step_logits[0, -1]), hf_logits[i], atol=1e-4, err_msg=f"draft step {i}")
        token = mx.argmax(step_logits[:, -1], -1)
        assert token.item() == hf_tokens[i], f"draft step {i}"
    # The drafter the engine uses proposes the same tokens.
    row = SpecRow(PROMPT, GreedyChoice(), SpecTelemetry("mtp", k=k), caches, last=int(first), hidden=hidden[:, -1:],
                  tokens=list(PROMPT))
    proposed, _ = MTPDrafter(assistant, target).propose([row], k, caches)
    assert proposed[0].tolist() == hf_tokens


def test_assisted_generation_equals_plain_greedy_in_both_stacks(pair):
    target_hf, assistant_hf, root = pair
    prompt = PROMPT * 3  # 57 tokens: past the 32-token window
    ids = torch.tensor([prompt])
    with torch.no_grad():
        plain = target_hf.generate(ids, max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assisted = target_hf.generate(ids, max_new_tokens=24, do_sample=False,
                                      assistant_model=assistant_hf)[0, len(prompt):].tolist()
    assert assisted == plain
    model, _ = load(str(root / "target"))
    drafter = MTPDrafter(load_assistant(root / "assistant"), Target(model))
    ours = list(itertools.islice(speculative_tokens(model, prompt, drafter, k=4, stats=SpecTelemetry("mtp", k=4)), 24))
    assert ours == plain  # MLX speculative output equals transformers' plain greedy
