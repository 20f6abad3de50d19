"""Speculation with an MTP head shipped inside the target's checkpoint (issue 42), through the real engine.

The fixture is a tiny hybrid Qwen3.5 (Gated DeltaNet and full-attention layers) in Hugging Face's layout with
`mtp.*` head weights, built by the fixture factory and its head distilled briefly on its target's greedy
continuations of a few prompts (`fixtures.mtp.train_prompts`): on those its drafts are often accepted, elsewhere
seldom, so rounds accept every number of drafts from 0 to k. Greedy output must equal plain decoding."""

import asyncio
import os

import pytest
from mlx_lm import load

from provider.engine.proposers import HeadDrafter
from provider.engine.spec_rounds import Speculator
from provider.jobs import Job, SamplingParams
from provider.models import capability
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.kind import KIND as NATIVE_HEAD
from provider.models.gemma4_target import Target
from provider.drafters.mtp.qwen3_5 import load_head
from provider.telemetry import SpecTelemetry
from provider.proofs.hidden_tap import install
from tests import mtp_checks
from tests.helpers import collect, greedy, make_node, run

NAME = "qwen3_5-mtp-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_is_read_from_config_and_head_tensors(target, tmp_path):
    config = capability.read_config(target)
    mtp_checks.head_found(target, config)
    # The key without the tensors (what mlx-community conversions ship) is not a head.
    import json
    import shutil

    from mlx.core import load as mx_load
    from mlx.core import save_safetensors

    stripped = tmp_path / "stripped"
    shutil.copytree(target, stripped)
    weights = {k: v for k, v in mx_load(str(stripped / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_safetensors(str(stripped / "model.safetensors"), weights)
    mtp_checks.no_head_found(stripped, config)
    assert json.loads((stripped / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    # Booked as the head alone (its tensors and activations), and its own K/V per token per row.
    need = NATIVE_HEAD.footprint(target, config, 3, 512)
    head_bytes = sum(v.nbytes for k, v in mx_load(str(target / "model.safetensors")).items() if k.startswith("mtp."))
    assert head_bytes < need < 4 * head_bytes + (64 << 20)
    assert NATIVE_HEAD.kv_shape(target, config).bytes_per_token_full == 2 * 2 * 16 * 4  # K and V, 2 heads x 16, fp32


def test_the_head_is_booked_once_as_the_drafter_never_inside_the_target(target):
    """mlx-lm's sanitize drops `mtp.*`: the target's weight estimate (the catalog's size, the load's footprint)
    is what the loaded target holds, to the byte, and the checkpoint's tensors are that plus the head the
    drafter's footprint books."""
    from provider.memory import estimate

    mtp_checks.booked_once(target, capability.read_config(target), load_head)
    # DeepSeek-V3 / GLM keep their head as the layers after the last (config num_nextn_predict_layers).
    deep = {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    names = {f"model.layers.{i}.mlp.w.weight": ("F32", [4]) for i in range(3)}
    assert estimate.weight_bytes(deep, names) == 2 * 16


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    n, ps = 24, mtp_checks.prompts(target)
    want = [mtp_checks.plain(target, p, n) for p in ps]
    alone, together, _ = mtp_checks.greedy_alone_and_together(target, NAME, ps, want, n)
    trained = [r[2].telemetry.speculation for r in alone[:4]]
    # The distilled prompts: the head's first draft is accepted most rounds (real acceptance, not a stand-in).
    assert sum(s.accepted for s in trained) / sum(s.rounds for s in trained) > 0.5
    assert together[0][2].telemetry.speculation.mean_batch > 2  # verified together with the others
    assert len({r[2].telemetry.speculation.accepted for r in alone + together}) > 2


def test_the_head_computes_what_mlx_vlms_qwen3_5_mtp_drafter_computes_on_the_same_weights(target):
    """The head as loaded here (drafters.mtp.qwen3_5) against mlx-vlm's Qwen3_5MTPDraftModel, loaded by mlx-vlm's
    own split of the same checkpoint: the same parameters, and on the prompt's pairs then four draft steps the
    same hidden state and draft tokens bit for bit, and the same K/V: V bit for bit, K within 1e-6 (mlx-lm's layer
    rotates with mx.fast.rope, mlx-vlm's with its own M-RoPE arithmetic: 2e-9 apart on one element here)."""
    pytest.importorskip("mlx_vlm.speculative.drafters.qwen3_5_mtp")
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter

    theirs = Qwen3_5MTPSplitter().load(target)
    model, tap, ours = mtp_checks.loaded(target, load_head)
    mtp_checks.same_parameters(dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters())))
    lm = model.language_model
    mtp_checks.drafts_as_mlx_vlms(target, model, tap, ours, theirs, lm.model.embed_tokens, lm.lm_head, k_tol=1e-6)


def test_sampled_rounds_with_the_head_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test with the head (mtp_checks.sampled_as_plain) at T = 0.15 with top_p
    and top_k. A low temperature keeps the samples near the continuations the head was distilled on, so a fifth of
    its drafts are accepted and the rest resampled."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params)


def test_auto_measures_the_head_at_load_and_declines_it_with_its_numbers_where_it_does_not_pay(target, tmp_path,
                                                                                               monkeypatch):
    """auto with the head: at load the node times its plain steps and the head's rounds (k = 1..4, one row and
    four) and a first acceptance, on its profiler thread, and each job's decision comes from those numbers. On
    costs where no k pays, greedy and sampled jobs decode plain with `not_profitable` and the numbers."""
    from provider import speculation as sp
    from tests.helpers import until

    async def profiled(node):
        await node.preload(NAME)
        await until(lambda: next(m for m in node.status().models if m.id == NAME).speculation, "the head's costs")
        return next(m for m in node.status().models if m.id == NAME)

    async def measured():
        node = make_node({NAME: target}, speculation="auto")
        status = await profiled(node)
        done = (await collect(node, Job("g", NAME, greedy(6), prompt_ids=tuple(train_prompts()[0]))))[2]
        await node.stop()
        return status, done.telemetry.speculation.as_dict()

    status, spec = run(measured())
    costs = status.speculation
    assert status.speculation_profile["source"] == "measured"
    assert costs["plain_token_ms"] > 0 and len(costs["round_ms"]) == 4 and min(costs["round_ms"]) > 0
    assert costs["rows"] == 4 and costs["plain_rows_ms"] > 0 and len(costs["round_rows_ms"]) == 4
    assert spec["decision"]["profile"]["source"] == "measured"
    assert (spec["mode"], spec["reason"]) == (("off", "not_profitable") if spec["decision"]["k"] == 0
                                              else ("mtp", "ok"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "fresh"))  # not the profile just kept: the given costs

    given = sp.SpecCosts(plain_token_s=0.010, round_s=(0.012, 0.016, 0.020, 0.024), rows=4, plain_rows_s=0.040,
                         round_rows_s=(0.080, 0.112, 0.144, 0.176))

    async def declined():
        node = make_node({NAME: target}, speculation="auto")
        node.models.profiler = lambda lm: sp.SpecProfile(given, {sp.GREEDY: 0.1, sp.SPECULATIVE_SAMPLING: 0.2})
        await profiled(node)
        out = []
        for params in (greedy(8), SamplingParams(max_tokens=8, temperature=0.7)):
            out.append((await collect(node, Job("j", NAME, params, prompt_ids=tuple(train_prompts()[1]))))[2])
        await node.stop()
        return [d.telemetry.speculation.as_dict() for d in out]

    for spec, acceptance in zip(run(declined()), (0.1, 0.2)):
        assert (spec["mode"], spec["reason"]) == ("off", "not_profitable")
        spec["decision"].pop("profile")
        assert spec["decision"] == {"k": 0, "acceptance": acceptance, "expected_speedup": {
            str(k): round(v, 3) for k, v in sp.speedups(given, acceptance).items()}}


def test_registration_says_which_models_speculate_and_with_what(fixtures_dir, target, tmp_path):
    """Registration's capabilities (from the files, before any load): the Qwen3.5 speculates with its own head,
    the Gemma 4 target with its assistant, the Llama with its draft model, Qwen3 with nothing; `provider models
    list` says which with its own head."""
    from coordinator_client.registration import model_infos

    drafters = {"g": fixtures_dir / "gemma4-tiny-assistant", "l": fixtures_dir / "llama-tiny-draft"}
    node = make_node({NAME: target, "g": fixtures_dir / "gemma4-tiny", "l": fixtures_dir / "llama-tiny",
                      "q": fixtures_dir / "qwen3-tiny"}, manager_kw={"drafters": drafters})
    caps = {i.id: i.capabilities for i in model_infos(node.status())}
    run(node.stop())
    assert (caps[NAME].mtp_capable, caps[NAME].native_mtp_heads, caps[NAME].speculates_with) == \
        (True, True, "own_mtp_head")
    assert (caps["g"].mtp_capable, caps["g"].speculates_with) == (True, "mtp_assistant")
    assert (caps["l"].draft_compatible, caps["l"].mtp_capable, caps["l"].speculates_with) == \
        (True, False, "draft_model")
    assert (caps["q"].mtp_capable, caps["q"].draft_compatible, caps["q"].speculates_with) == (False, False, "")

    import shutil
    import subprocess
    import sys

    models = tmp_path / "cache" / "provider" / "models"
    shutil.copytree(target, models / NAME)
    for name in ("gemma4-tiny", "gemma4-tiny-assistant", "qwen3-tiny"):
        shutil.copytree(fixtures_dir / name, models / name)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # tests/conftest.py: children run without torch
    listing = subprocess.run([sys.executable, "-m", "provider", "models", "list"], capture_output=True, text=True,
                             env=env, timeout=120, check=True)
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert rows[NAME].endswith("[mtp: own head]") and rows["gemma4-tiny"].endswith("[mtp]"), listing.stdout
    assert "[" not in rows["qwen3-tiny"]


def test_grammar_rows_and_logprob_jobs_with_the_head_equal_plain_decoding_together(target):
    """Two rows under JSON schemas (drafts proposed under the grammar's masks), one asking logprobs and one free,
    speculating together with the head: each emits the tokens of its plain run alone, the constrained ones
    validate, and the logprobs reported are the target's own, as plain decoding reports them."""
    import json

    import jsonschema

    from provider.constraints import OutputRules, ResponseFormat
    from provider.outputs import Tokens

    schemas, messages = mtp_checks.JSON_SCHEMAS, mtp_checks.JSON_MESSAGES
    ps = mtp_checks.prompts(target)

    def jobs(tag: str, speculation: str) -> list[Job]:
        return [*(Job(f"{tag}s{i}", NAME, greedy(48), messages=messages, speculation=speculation,
                      rules=OutputRules(ResponseFormat("json_schema", s, "x"))) for i, s in enumerate(schemas)),
                Job(f"{tag}l", NAME, greedy(24, logprobs=2), prompt_ids=tuple(ps[0]), speculation=speculation),
                Job(f"{tag}f", NAME, greedy(24), prompt_ids=tuple(ps[5]), speculation=speculation)]

    async def main():
        node = make_node({NAME: target}, max_concurrent_jobs=4, speculation_k=3)
        plain = [await collect(node, j) for j in jobs("off", "off")]
        together = await asyncio.gather(*(collect(node, j) for j in jobs("on", "on")))
        await node.stop()
        return plain, together

    plain, together = run(main())
    for i, ((ids, text, done, events), (want, _, _, plain_events)) in enumerate(zip(together, plain)):
        spec = done.telemetry.speculation
        assert (spec.mode.value, spec.reason) == ("mtp", "ok") and spec.rounds > 0, (i, spec)
        assert ids == want, f"job {i}: speculation changed the output"
        if i < 2:
            jsonschema.validate(json.loads(text), schemas[i])
            assert done.telemetry.constraint == "json_schema"
        if i == 2:
            got = [lp for e in events if isinstance(e, Tokens) for lp in e.logprobs]
            ref = [lp for e in plain_events if isinstance(e, Tokens) for lp in e.logprobs]
            assert len(got) == len(ref) == 24
            for a, b in zip(got, ref):
                assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t[0] for t in a.top] == [t[0] for t in b.top]
    assert together[0][2].telemetry.speculation.mean_batch > 1.5  # the rows verified together
    assert sum(r[2].telemetry.speculation.accepted for r in together[:2]) > 0  # drafts under the grammar accepted


def test_a_finished_row_and_its_caches_are_not_held_by_the_head(target):
    """A job's row (its target caches and the head's) is freed when the job ends: the drafter keeps no reference
    to the last round's rows, or their memory outlived the ledger's booking until the next round (seen by
    tools/bench/memory_ledger.py's phase m as MLX memory at idle past the ledger)."""
    import gc
    import weakref

    model, _ = load(str(target))
    install(model)
    spec = Speculator(model, HeadDrafter(load_head(target, model), Target(model)))
    row = spec.new_row(train_prompts()[0], stats=SpecTelemetry("mtp", k=3))
    while not spec.read(row, 2048):
        pass
    spec.begin([row])
    spec.round([row])
    spec.round([row])
    gone = weakref.ref(row)
    del row
    gc.collect()
    assert gone() is None
