"""Whether two checkpoints share one vocabulary: what a draft model or a Gemma 4 assistant must (its drafts are the
target's token ids), decided from config and tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

from ..memory.estimate import text_config
from .kind import OK


def vocab_size(config: dict) -> int | None:
    return text_config(config).get("vocab_size") or config.get("vocab_size")


def same_vocabulary(a: Path, b: Path, config_a: dict, config_b: dict) -> tuple[bool, str]:
    if vocab_size(config_a) != vocab_size(config_b):
        return False, f"vocab_size {vocab_size(config_b)} != target {vocab_size(config_a)}"
    ta, tb = a / "tokenizer.json", b / "tokenizer.json"
    if ta.exists() and tb.exists():
        try:
            va, vb = _tokenizer_vocab(ta), _tokenizer_vocab(tb)
        except (OSError, ValueError, AttributeError, RecursionError) as e:
            return False, f"a tokenizer.json is unreadable: {type(e).__name__}"
        if va != vb:
            return False, "tokenizer vocabularies differ"
    return True, OK


def _tokenizer_vocab(path: Path):
    return json.loads(path.read_text()).get("model", {}).get("vocab")
