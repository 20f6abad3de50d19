"""The registry of drafter kinds (provider.drafters.registry), one row a kind (and a DFlash variant) over the fixture
checkpoints the family tests build: each is recognised as its own kind (its own variant) and by no kind (variant)
tried before it; its pair check passes for its target and fails with its reason for another; its footprint and
per-row KV are positive (none for a kind that keeps none); `provider models list` prints its tag.

Adding a kind or a variant: one row here (the table checks that every registered one has a row)."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from provider.drafters import registry
from provider.drafters.dflash.variants import VARIANTS, variant_of
from provider.drafters.kind import OK
from provider.memory.checkpoint import read_config
from provider.models import capability
from tools.fixtures import dflash, eagle3


@dataclass(frozen=True)
class Row:
    kind: str  # its kind's name
    target: tuple[str, str]  # ("head" or "fixtures", fixture name): its target
    drafter: str  # "own" (the target's checkpoint), "dflash" / "eagle3" (beside it: the fixture's drafter_dir) or a
    # fixtures_dir name
    wrong: str  # a fixtures_dir target it does not draft for
    why: str  # in the reason it gives for it
    variant: str | None = None  # a DFlash variant's row name
    keeps_kv: bool = True  # it keeps KV of its own per row
    config: Callable[[dict], dict] | None = None  # the drafter's config rewritten (on a copy): a kind or variant whose
    # checkpoints differ from a built fixture's in their config alone


ROWS = {
    "native head": Row("own_mtp_head", ("head", "qwen3_5-mtp-tiny"), "own", "qwen3-tiny", "not_mtp_capable"),
    "dflash": Row("dflash", ("head", "qwen3-dflash-tiny"), "dflash", "gemma4-tiny", "DFlash vocab_size",
                  variant="dflash"),
    "dspark": Row("dflash", ("head", "qwen3-dspark-tiny"), "dflash", "gemma4-tiny", "DFlash vocab_size",
                  variant="dspark"),
    "dflash2": Row("dflash", ("head", "qwen3-dflash2-tiny"), "dflash", "gemma4-tiny", "DFlash vocab_size",
                   variant="dflash2"),
    "gemma4 dflash": Row("dflash", ("head", "gemma4-dflash-tiny"), "dflash", "qwen3-tiny",
                         "a Gemma 4 drafter (gemma4_dflash) does not draft for qwen3 targets", variant="gemma4_dflash"),
    "gemma4 dspark": Row("dflash", ("head", "gemma4-dspark-tiny"), "dflash", "qwen3-tiny",
                         "a Gemma 4 drafter (gemma4_dspark) does not draft for qwen3 targets", variant="gemma4_dspark"),
    "muse_glimmer": Row("dflash", ("head", "muse_glimmer-dflash-tiny"), "dflash", "qwen3-tiny",
                        "a muse_glimmer drafter does not draft for qwen3 targets", variant="muse_glimmer"),
    "laguna": Row("dflash", ("head", "laguna-dflash-tiny"), "dflash", "qwen3-tiny",
                  "a laguna drafter does not draft for qwen3 targets", variant="laguna"),
    "eagle3": Row("eagle3", ("head", "llama-eagle3-tiny"), "eagle3", "qwen3-tiny", "EAGLE-3"),
    "assistant": Row("mtp_assistant", ("fixtures", "gemma4-tiny"), "gemma4-tiny-assistant", "qwen3-tiny",
                     "not_mtp_capable: target is not Gemma 4", keeps_kv=False),
    "draft model": Row("draft_model", ("fixtures", "llama-tiny"), "llama-tiny-draft", "qwen3-tiny",
                       "vocab_size 512 != target 384"),
}


def test_every_kind_and_every_dflash_variant_has_a_row():
    assert {k.name for k in registry.KINDS} == {row.kind for row in ROWS.values()}
    assert {v.name for v in VARIANTS} == {row.variant for row in ROWS.values() if row.variant}


@pytest.fixture
def pair(request, fixtures_dir, head_fixture, tmp_path):
    """(row, target, drafter) of the row named by the test's parameter."""
    row = ROWS[request.param]
    where, name = row.target
    target = head_fixture(name) if where == "head" else fixtures_dir / name
    drafter = {"own": target, "dflash": dflash.drafter_dir(target), "eagle3": eagle3.drafter_dir(target)}.get(
        row.drafter, fixtures_dir / row.drafter)
    if row.config is not None:
        drafter = Path(shutil.copytree(drafter, tmp_path / "drafter"))
        (drafter / "config.json").write_text(json.dumps(row.config(json.loads((drafter / "config.json").read_text()))))
    return row, target, drafter


@pytest.mark.parametrize("pair", sorted(ROWS), indirect=True)
def test_a_kind_recognises_pairs_books_and_tags_its_drafters(pair, fixtures_dir):
    from provider.commands.model_commands import describe, list_line
    from provider.models.store import StoredModel
    from provider.settings import Settings

    row, target, drafter = pair
    kind, config, target_config = registry.named(row.kind), read_config(drafter), read_config(target)
    assert [k.name for k in registry.KINDS if k.claims(target, drafter, config)][:1] == [row.kind]
    assert registry.kind_of(target, drafter, config) is kind
    if row.variant:  # recognised as its own variant, and by none tried before it
        assert [v.name for v in VARIANTS if v.recognised(config)][0] == variant_of(config).name == row.variant

    assert kind.pair(target, target_config, drafter, config) == OK
    own = None if drafter == target else drafter
    caps = capability.with_drafter(capability.detect(target, target_config), target, own, target_config)
    assert (caps.speculates_with, caps.drafter_reason) == (row.kind, OK)
    wrong = fixtures_dir / row.wrong
    why = kind.pair(wrong, read_config(wrong), wrong if own is None else drafter, read_config(wrong) if own is None
                    else config)
    assert why != OK and row.why in why, why

    assert kind.footprint(drafter, config, 3, 512) > 0
    shape = kind.kv_shape(drafter, config)
    assert (shape.bytes_per_token_full + shape.bytes_per_token_sliding > 0) if row.keeps_kv else shape is None

    listed = describe(Settings(), StoredModel("m", str(target), target, "configured", drafter=own and str(own)),
                      1 << 40)
    assert list_line(listed).endswith(f"  [{kind.tag}]"), list_line(listed)
