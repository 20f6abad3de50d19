"""Capability detection reads config files and safetensors headers only."""

import json
import shutil

import mlx.core as mx
import pytest

from provider.memory.estimate import kv_shape
from provider.memory.checkpoint import HeaderError, open_checkpoint, read_safetensors_header
from provider.models import capability
from provider.models.store import find_drafter_for


def test_gemma4_with_its_assistant_is_mtp_capable(fixtures_dir):
    target, assistant = fixtures_dir / "gemma4-tiny", fixtures_dir / "gemma4-tiny-assistant"
    caps = capability.detect(target)
    assert caps.family == "gemma4" and caps.sliding_window == 32 and caps.kv_shared_layers == 2
    assert not caps.is_drafter and not caps.native_mtp_heads
    paired = capability.with_drafter(caps, target, assistant, capability.read_config(target))
    assert paired.mtp_capable and paired.drafter_reason == "ok"
    assert capability.detect(assistant).is_drafter
    assert find_drafter_for(target, [fixtures_dir / "qwen3-tiny", assistant]) == assistant


def test_qwen3_is_not_mtp_capable(fixtures_dir):
    q = fixtures_dir / "qwen3-tiny"
    caps = capability.with_drafter(capability.detect(q), q, None, capability.read_config(q))
    assert not caps.mtp_capable and caps.drafter_reason == "not_mtp_capable"
    assert not capability.pair_assistant(q, fixtures_dir / "gemma4-tiny-assistant").paired


def test_llama_draft_model_is_draft_compatible(fixtures_dir):
    t, d = fixtures_dir / "llama-tiny", fixtures_dir / "llama-tiny-draft"
    caps = capability.with_drafter(capability.detect(t), t, d, capability.read_config(t))
    assert caps.draft_compatible and not caps.mtp_capable
    other = capability.pair_draft_model(t, fixtures_dir / "qwen3-tiny")
    assert not other.paired and "vocab" in other.reason


def test_mismatched_assistant_is_not_paired_with_reason(fixtures_dir, tmp_path):
    bad = tmp_path / "bad-assistant"
    shutil.copytree(fixtures_dir / "gemma4-tiny-assistant", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["backbone_hidden_size"] = 1536
    (bad / "config.json").write_text(json.dumps(cfg))
    p = capability.pair_assistant(fixtures_dir / "gemma4-tiny", bad)
    assert not p.paired and "backbone_hidden_size 1536 != target hidden_size 64" in p.reason


def test_published_assistant_configs_parse(shared_configs):
    for path in shared_configs:
        cfg = json.loads(path.read_text())
        assert cfg["model_type"] == "gemma4_assistant"
        target = {"model_type": "gemma4", "text_config": {"hidden_size": cfg["backbone_hidden_size"],
                                                           "vocab_size": cfg["text_config"]["vocab_size"]}}
        d = path.parent / "x"
        assert capability.pair_assistant(d, d, target, cfg).paired
        wrong = {"model_type": "gemma4", "text_config": {"hidden_size": 1, "vocab_size": 262144}}
        assert "backbone_hidden_size" in capability.pair_assistant(d, d, wrong, cfg).reason


@pytest.fixture
def shared_configs():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "shared" / "configs"
    files = sorted(root.glob("*.json"))
    if not files:
        pytest.skip("../shared/configs is not next to this checkout")
    return files


def _with_mtp(src, dst, keep_tensors: bool):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = mx.load(str(dst / "model.safetensors"))
    if keep_tensors:
        weights["model.layers.2.mtp_block.weight"] = mx.zeros((4, 4))  # layer index >= num_hidden_layers
    mx.save_safetensors(str(dst / "model.safetensors"), weights)


def test_native_mtp_heads_need_config_and_tensors(fixtures_dir, tmp_path):
    _with_mtp(fixtures_dir / "qwen3-tiny", tmp_path / "stripped", keep_tensors=False)
    caps = capability.detect(tmp_path / "stripped")
    assert caps.native_mtp_declared == 1 and caps.native_mtp_heads is False
    _with_mtp(fixtures_dir / "qwen3-tiny", tmp_path / "kept", keep_tensors=True)
    assert capability.detect(tmp_path / "kept").native_mtp_heads is True


def test_kv_estimate_caps_sliding_layers_and_skips_shared():
    cfg = json.loads(json.dumps({"text_config": {
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "global_head_dim": 32, "num_kv_shared_layers": 2, "sliding_window": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}}))
    kv = kv_shape(cfg, dtype_bytes=2)
    # Non-shared layers 0..3: three sliding of 16-dim heads and one full of 32-dim heads.
    assert kv.bytes_per_token_sliding == 3 * 2 * 16 * 2
    assert kv.bytes_per_token_full == 1 * 2 * 32 * 2
    assert kv.bytes_for(1000) == 1000 * kv.bytes_per_token_full + 32 * kv.bytes_per_token_sliding


def test_corrupt_safetensors_are_reported(fixtures_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(fixtures_dir / "qwen3-tiny", bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeaderError, match="tensors end at byte"):
        read_safetensors_header(bad / "model.safetensors")
    (bad / "model.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(HeaderError):
        open_checkpoint(bad).tensors
