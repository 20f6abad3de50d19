"""mlx-vlm's own EAGLE-3 speculative generation on an mlx-lm Llama target: the baseline bench_mtp_families.py
measures the node's EAGLE-3 drafter against (`--fixture llama-eagle3-tiny`).

mlx-vlm runs EAGLE-3 only on targets of its own model zoo that capture layers (`capture_layer_ids`: Qwen3.5, Gemma
4, LFM2, ...), not on a Llama; capture_target's `CaptureTarget` lets its round loop (`_eagle3_rounds`) drive
mlx-lm's Llama as it drives those: the outputs of the captured layers beside the logits, and the rollback it calls
after each verify. The loop, the drafter (mlx-vlm's Eagle3DraftModel on the checkpoint's weights) and its prefill
from the prompt's hidden states are mlx-vlm's own. With no `logits_from_hidden` on the target, its verify takes the
full vocabulary's argmax (its "hot" verify, over the draft vocabulary only, would not be exact).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx

from tools.bench.capture_target import CaptureTarget, argmax, timed


def load_drafter(drafter: Path):
    """mlx-vlm's Eagle3DraftModel on the checkpoint's weights (its config in mlx-vlm's Speculators form)."""
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config, TextConfig
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    c = json.loads((drafter / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "rope_theta")
    layer = TextConfig(**{k: c[k] for k in keys if k in c}, num_hidden_layers=1)
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    model = Eagle3DraftModel(Eagle3Config(transformer_layer_config=layer, draft_vocab_size=c["draft_vocab_size"],
                                          target_layer_ids=ids or []))
    weights = {}
    for f in sorted(drafter.glob("*.safetensors")):
        weights |= {k.replace("midlayer.", "layers.0."): v for k, v in mx.load(str(f)).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=False)  # its embedding: the target's (bind)
    return model


def runs(path: Path, drafter: Path, ps: list[list[int]], n: int, k: int) -> tuple[list[list[int]], int, int, float]:
    """(outputs, tokens delivered, target forwards, wall seconds): greedy, k drafts a round (block k + 1)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.eagle3 import _eagle3_capture_layer_ids, _eagle3_rounds

    model, _ = load(str(path))
    target, draft = CaptureTarget(model), load_drafter(drafter)
    ids = _eagle3_capture_layer_ids(draft)

    def one(p: list[int]) -> list[int]:
        cache = make_prompt_cache(model)
        prompt = mx.array([p])
        out = target(prompt, cache, capture_layer_ids=ids)
        first = int(argmax(out.logits[:, -1]).item())
        rounds = _eagle3_rounds(target, draft, cache, mx.concatenate(out.hidden_states, axis=-1),
                                prompt_tokens=prompt, first_bonus=first, max_tokens=n, sampler=argmax,
                                draft_block_size=k + 1, greedy_sampling=True)
        return [first] + [int(t) for t, _ in itertools.islice(rounds, n - 1)]

    return timed(target, one, ps)
