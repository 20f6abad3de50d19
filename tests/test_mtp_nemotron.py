"""Speculation with the MTP head a Nemotron-H checkpoint ships (issue 42), through the real engine.

The fixture is a tiny Nemotron-H (Mamba2, attention, MoE and MLP blocks by `hybrid_override_pattern`) in Hugging
Face's layout with `mtp.*` head weights of the head's own pattern (attention then MoE), its head distilled briefly
on its target's continuations of `fixtures.mtp.train_prompts`: rounds accept every number of drafts from 0 to k,
so the Mamba2 layers are rolled back (provider.engine.recurrent) from every point. Greedy output must equal plain
mlx-lm decoding."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache

from provider.engine import recurrent
from provider.jobs import Job, SamplingParams
from provider.models import capability
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.kind import KIND as NATIVE_HEAD
from provider.models.footprint import kv_shape_of
from provider.drafters.mtp.nemotron_h import load_head, serves
from tests import mtp_checks
from tests.helpers import collect, greedy, make_node, run
from tools.harness.isolated import run_isolated

NAME = "nemotron_h-mtp-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_is_read_from_config_and_head_tensors_and_a_broken_head_is_refused(target, tmp_path):
    config = capability.read_config(target)
    assert mtp_checks.head_found(target, config).speculates_with == "own_mtp_head"
    # A head with Mamba2 blocks is not one this node (or mlx-vlm) loads.
    assert not serves(config | {"mtp_hybrid_override_pattern": "M*"}) and not serves(config | {
        "num_nextn_predict_layers": 0})
    weights = dict(mx.load(str(target / "model.safetensors")))
    stripped = tmp_path / "stripped"
    shutil.copytree(target, stripped)
    mx.save_safetensors(str(stripped / "model.safetensors"), {k: v for k, v in weights.items()
                                                              if not k.startswith("mtp.")})
    mtp_checks.no_head_found(stripped, config)
    # Hostile heads (a tensor missing, one misshaped) fail their load with an error the loader turns into
    # "no drafter", and the target still decodes.
    model, _ = load(str(target))
    for name, broken in (("missing", {k: v for k, v in weights.items() if k != "mtp.layers.0.eh_proj.weight"}),
                         ("misshaped", weights | {"mtp.layers.0.eh_proj.weight": mx.zeros((64, 64))})):
        bad = tmp_path / name
        shutil.copytree(target, bad)
        mx.save_safetensors(str(bad / "model.safetensors"), broken)
        with pytest.raises(ValueError):
            load_head(bad, model)
    node = make_node({NAME: bad}, speculation="auto")
    ids, _, done, _ = run(_one(node, Job("h", NAME, greedy(4), prompt_ids=tuple(train_prompts()[0]))))
    assert len(ids) == 4 and done.telemetry.speculation.mode.value == "off"


async def _one(node, job):
    out = await collect(node, job)
    await node.stop()
    return out


def test_the_footprint_books_the_head_and_the_estimate_reads_the_block_pattern(target):
    """The head is booked once, as the drafter (its tensors, activations and its attention block's K/V), never
    inside the target; the target's per-row books are what mlx-lm's caches hold: K/V for its attention block
    only, one Mamba2 state per Mamba2 block (conv window + float32 SSM state), nothing for MLP / MoE blocks."""
    config = capability.read_config(target)
    model, _ = mtp_checks.booked_once(target, config, load_head)
    assert NATIVE_HEAD.kv_shape(target, config).bytes_per_token_full == 2 * 2 * 16 * 4  # one attention block, fp32

    caches = model.make_cache()
    model(mx.array([list(range(256))]), cache=caches)  # 256: the K/V buffer's own step, so none is spare
    mx.eval([c.state for c in caches])
    shape = kv_shape_of(target, config)
    state = sum(c.nbytes for c in caches if isinstance(c, ArraysCache))
    assert (shape.bytes_per_row, shape.bytes_for(256)) == (state, sum(c.nbytes for c in caches))
    # A config without num_hidden_layers (transformers derives it from the blocks) books the same.
    assert kv_shape_of(target, {k: v for k, v in config.items() if k != "num_hidden_layers"}) == shape
    named = config | {"hybrid_override_pattern": None,
                      "layers_block_type": ["mamba", "attention", "mamba", "moe", "mlp", "mamba"]}
    assert kv_shape_of(target, named) == shape


def _mamba_states(caches):
    return [c.cache for c in caches if isinstance(c, ArraysCache)]


def test_a_rewound_mamba2_state_is_the_state_plain_decoding_reaches(target, monkeypatch):
    """After a verify of k + 1 positions, a row keeping n + 1 of them gets each Mamba2 layer's state (conv window
    and SSM state) bit for bit as its mixer reaches it a position at a time, as plain decoding runs it, from the
    state before the verify over the same inputs; a full acceptance keeps the verify's own, equal the same way.
    mlx-lm's chunked scan over the width at once does not (why the round steps the SSM: ~1e-8 apart); and the
    whole model's rewound caches are within 1e-6 of plain decoding's over the kept tokens (the attention and
    projections' width-k+1 rounding, as for any target). In a process of its own on MLX's reference BLAS
    (tools/harness/blas.py), which rounds a projection alike at every width: the comparisons across widths rely
    on it."""
    monkeypatch.setenv("TESTS_BLAS", "reference")
    run_isolated(_rewound_mamba2_state, str(target))


def _rewound_mamba2_state(target: str) -> None:
    target = Path(target)
    model, _ = load(str(target))
    recurrent.install(model)
    prompt, drafts = train_prompts()[0], mx.array([[5, 77, 140, 9]])
    base = {id(m): type(m).__mro__[1] for _, m in recurrent._mixers(model)}

    def read():
        caches = model.make_cache()
        model(mx.array([prompt]), cache=caches)
        mx.eval([c.state for c in caches])
        return caches

    for kept in (1, 2, 4):
        caches = read()
        rewind = recurrent.begin(model, caches)
        model(drafts, cache=caches)
        rewind.done()
        rewind.row(caches, 0, kept, 4)
        mx.eval(recurrent.evaluated(caches))
        stepped, chunked = read(), read()
        for (layer, mixer), inputs in zip(recurrent._mixers(model), rewind.inputs):
            own = base[id(mixer)]
            for j in range(kept):
                own.__call__(mixer, inputs[:, j:j + 1], None, stepped[layer])
            own.__call__(mixer, inputs[:, :kept], None, chunked[layer])
            for a, b in zip(caches[layer].cache, stepped[layer].cache):
                assert mx.array_equal(a, b).item(), (kept, layer)
        if kept > 1:
            assert any(not mx.array_equal(a[1], b[1]).item()
                       for a, b in zip(_mamba_states(caches), _mamba_states(chunked)))
        plain_caches = read()
        for j in range(kept):
            model(drafts[:, j:j + 1], cache=plain_caches)
        worst = max(mx.abs(a - b).max().item() for x, y in zip(_mamba_states(caches), _mamba_states(plain_caches))
                    for a, b in zip(x, y))
        assert worst < 1e-6, worst


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target, monkeypatch):
    """Alone, then 8 together (mixed prompt lengths, rows ending at their own steps), then the first prompt again
    extended (its prefix served from the prefix cache's copy of the recurrent state): each job's tokens are plain mlx-lm
    decoding's, up to the end token. Rounds accept 0 to k - 1 drafts (the Mamba2 rollback keeping 1 to k of k + 1
    positions, each seen) and all k."""
    rewound = []
    row = recurrent.Rewind.row

    def seen(self, caches, i, kept, width):
        rewound.append(kept)
        return row(self, caches, i, kept, width)

    monkeypatch.setattr(recurrent.Rewind, "row", seen)
    n = 24
    ps = mtp_checks.prompts(target)
    _, tok = load(str(target))

    def truth(p):
        out = mtp_checks.plain(target, p, n)
        return out[:out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out

    want = [truth(p) for p in ps]
    longer = ps[7] + want[7] + [5, 6]  # past the entry job 7 left (its prompt and output): a prefix hit

    async def prefix_hit(node):
        return await collect(node, Job("again", NAME, greedy(n), prompt_ids=tuple(longer)))

    alone, together, again = mtp_checks.greedy_alone_and_together(target, NAME, ps, want, n, then=prefix_hit)
    trained = [r[2].telemetry.speculation for r in alone[:4]]
    assert 0.5 < sum(s.accepted for s in trained) / sum(s.rounds for s in trained) < 2.5  # some, not all, k = 3
    assert set(rewound) == {1, 2, 3, 4}  # kept n + 1 of k + 1 = 4: every number of drafts accepted, 0 to k
    assert together[0][2].telemetry.speculation.mean_batch > 2
    assert again[0] == truth(longer) and again[2].usage.cached_prompt_tokens >= len(ps[7])


def test_the_head_computes_what_mlx_vlms_nemotron_h_mtp_drafter_computes_on_the_same_weights(target):
    """The head as loaded here against mlx-vlm's NemotronHMTPDraftModel from its own `load_drafter(path,
    kind="mtp")` of the same checkpoint: the same parameters, and on the prompt's pairs then four draft steps the
    same hidden state and draft tokens bit for bit, and the same K/V."""
    pytest.importorskip("mlx_vlm.speculative.drafters.nemotron_h_mtp")
    from mlx_vlm.speculative.drafters import load_drafter

    theirs, kind = load_drafter(str(target), kind="mtp")
    assert kind == "mtp"
    model, tap, ours = mtp_checks.loaded(target, load_head)
    mtp_checks.same_parameters(dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters())))
    theirs.validate_target_compatibility = lambda target: None  # it checks for mlx-vlm's own target class
    mtp_checks.drafts_as_mlx_vlms(target, model, tap, ours, theirs, model.backbone.embeddings, model.lm_head)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params)


def test_the_config_is_what_mlx_lm_and_mlx_vlm_read(target):
    config = json.loads((target / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M*ME-M" and config["mtp_hybrid_override_pattern"] == "*E"
    names = set(mx.load(str(target / "model.safetensors")))
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.1.final_layernorm.weight", "mtp.layers.1.mixer.experts.3.up_proj.weight",
            "backbone.layers.3.mixer.experts.0.down_proj.weight", "backbone.layers.0.mixer.conv1d.weight"} <= names


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    """A Nemotron-H whose Mamba2 state dominates: 3 Mamba2 blocks of 32 heads x 64 x 128 float32 (1 MiB each a
    row), one attention block of 256 bytes of K/V a token."""
    from tools.fixtures.mtp_nemotron import make_nemotron_h_mtp_tiny

    out = tmp_path_factory.mktemp("stateful") / "nemotron_h-stateful"
    make_nemotron_h_mtp_tiny(out, train=False, mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128)
    return out


def test_a_nemotron_batch_and_its_prefix_entries_hold_what_the_books_say(stateful):
    """test_memory_books' hybrid check on Nemotron-H: 8 jobs at once ending at their own steps, MLX within the
    ledger all along, and idle only the weights and the prefix entries, each its row's own Mamba2 state (conv
    window and SSM state copied out of the batch's arrays) and its tokens' K/V."""
    from tests.test_memory_books import _hybrid_books, _within
    from tools.harness.isolated import run_isolated

    m = run_isolated(_hybrid_books, str(stateful))
    assert m["jobs_kv"] == 0 and len(m["entries"]) >= 8
    state = 3 * 4 * (32 * 64 * 128 + 3 * (32 * 64 + 2 * 2 * 128))
    assert all(state <= e < state + 300 * 256 for e in m["entries"]), (state, m["entries"])
    assert not m["over"], m["over"]
    assert _within(m["held"], m["weights"] + m["prefix"]), {k: v for k, v in m.items() if isinstance(v, int)}
