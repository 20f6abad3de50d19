"""What bare mlx-lm produces, for parity checks."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mlx_lm import load
from mlx_lm.generate import stream_generate


@lru_cache(maxsize=8)
def load_cached(path: str):
    return load(path)


def chat_ids(path: Path, messages: list[dict]) -> list[int]:
    _, tok = load_cached(str(path))
    return list(tok.apply_chat_template(messages, add_generation_prompt=True))


def greedy(path: Path, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """mlx-lm's own greedy tokens (without the EOS it stops on) and text, as mlx_lm.generate returns it."""
    model, tok = load_cached(str(path))
    ids, text = [], []
    for r in stream_generate(model, tok, prompt_ids, max_tokens=max_tokens):
        text.append(r.text)
        if r.finish_reason != "stop":
            ids.append(r.token)
    return ids, "".join(text)


def greedy_tokens(path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return greedy(path, prompt_ids, max_tokens)[0]
