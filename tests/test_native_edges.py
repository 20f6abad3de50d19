"""Values that would reach native code unchecked: each is refused or bounded before MLX sees it.

The checkpoints here are built from the fixture factory's parts, each with one edge real checkpoints have:
a tokenizer that knows tokens the weights do not, and weights that score ids the tokenizer cannot decode.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error
from tools.fixtures import factory
from provider.models.default import DEMO_TARGET
from provider.types import Cause
from tests.helpers import collect, greedy, make_node, run


def _tokenizer_beyond_the_weights(src, out):
    """llama-tiny with one added token whose id is past the embedding's rows."""
    shutil.copytree(src, out)
    rows = json.loads((out / "config.json").read_text())["vocab_size"]
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": rows, "content": "<|beyond|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def _weights_beyond_the_tokenizer(out, *, hidden=64, layers=2, seed=7, tokenizer_from=None):
    """A Llama whose output scores 88 ids past its 512-token tokenizer, and scores them highest: those rows of
    the head are 50 x real rows, so for any hidden state the best padded id outscores every real one."""
    factory._mkdir(out)
    if tokenizer_from is None:
        ids = factory.build_tokenizer(out, 512, factory.CHATML_TEMPLATE, "<eos>", add_bos=True)
    else:  # a draft model: the target's tokenizer, as a same-vocabulary drafter has
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, out / name)
        ids = json.loads((tokenizer_from / "ids.json").read_text())
    (out / "ids.json").write_text(json.dumps(ids))
    config = factory._llama_config(ids, 600, hidden, layers)
    weights = factory._random_weights(config, seed=seed)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([head[:512], head[:88] * 50], axis=0)
    factory._save(out, config, weights)
    return out


def test_a_prompt_token_past_the_embedding_is_refused_before_mlx(fixtures_dir, tmp_path):
    model = _tokenizer_beyond_the_weights(fixtures_dir / "llama-tiny", tmp_path / "beyond")
    node = make_node({"m": model})

    async def main():
        _, _, end, _ = await collect(node, Job("a", "m", greedy(4), prompt="The cache <|beyond|>"))
        assert isinstance(end, Error) and end.cause == Cause.INVALID_REQUEST and end.param == "prompt", end
        assert "no embedding" in end.message
        assert isinstance((await collect(node, Job("b", "m", greedy(4), prompt="The cache")))[2], Done)
        await node.stop()

    run(main())


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("speculation", ["off", "on"])
def test_sampled_ids_stay_inside_what_the_detokenizer_decodes(fixtures_dir, tmp_path, temperature, speculation):
    model = _weights_beyond_the_tokenizer(tmp_path / "padded")
    drafters = {}
    if speculation == "on":
        drafters["m"] = _weights_beyond_the_tokenizer(tmp_path / "draft", hidden=32, layers=1, seed=8,
                                                      tokenizer_from=model)
    node = make_node({"m": model}, speculation=speculation, manager_kw={"drafters": drafters})

    async def main():
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3)
        ids, _, end, _ = await collect(node, Job("a", "m", params, prompt="The cache"))
        assert isinstance(end, Done), end
        assert ids and max(ids) < 512
        assert end.telemetry.speculation.mode == ("draft" if speculation == "on" else "off")
        await node.stop()

    run(main())


def test_a_tiny_temperature_samples_the_argmax_on_a_half_precision_model():
    node = make_node({"demo": DEMO_TARGET})  # fp16 weights

    async def main():
        texts = []
        for t in (0.0, 1e-5, 1e-300, 4.9e-324):
            params = SamplingParams(max_tokens=12, temperature=t, seed=1)
            texts.append((await collect(node, Job(f"t{t}", "demo", params, prompt="The cache")))[1])
        assert texts[1:] == [texts[0]] * 3, texts
        await node.stop()

    run(main())


def test_preparing_a_prompt_fetches_the_tokenizer_and_config_never_the_weights(fixtures_dir, tmp_path, monkeypatch):
    import threading

    import huggingface_hub

    from provider.models.catalog import Catalog
    from provider.models.residency import Residency
    from provider.memory.budget import Budget
    from provider.models.store import StoredModel
    from provider.node import Node
    from provider.settings import Settings

    fetched: list[tuple[str, list[str]]] = []

    def fake_snapshot_download(repo_id, *, allow_patterns, local_files_only=False, **_):
        # Stands in for the Hugging Face Hub (no network here): a repo that is not cached, then "downloaded"
        # from a local fixture, only the files the patterns ask for.
        if local_files_only:
            raise FileNotFoundError("not cached")
        fetched.append((threading.current_thread().name, list(allow_patterns)))
        out = tmp_path / "hub" / "_".join(allow_patterns)[:40].replace("*", "x")
        out.mkdir(parents=True, exist_ok=True)
        for f in (fixtures_dir / "qwen3-tiny").iterdir():
            if any(f.match(p) for p in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    stored = [StoredModel("org/tiny", "org/tiny", None, "configured")]
    node = Node(Settings(), Residency(Catalog(stored, allow_download=True), Budget(4 << 30, 0, "test")))
    node.start()

    async def main():
        _, _, end, _ = await collect(node, Job("a", "org/tiny", greedy(3), prompt="The cache"))
        assert isinstance(end, Done), end
        await node.stop()

    run(main())
    prompt_fetches = [patterns for thread, patterns in fetched if thread.startswith("prompts")]
    assert prompt_fetches and all(not any("safetensors" in p for p in pats) for pats in prompt_fetches), fetched
    assert any(any("safetensors" in p for p in pats) for thread, pats in fetched if thread.startswith("model-loader"))
