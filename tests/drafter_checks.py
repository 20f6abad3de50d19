"""What the separate-drafter families' tests check (issue 42), run the same way for each: tests/test_eagle3.py
(EAGLE-3) and test_dflash.py (DFlash), each a target with its drafter checkpoint beside it. Each test keeps its
family's own cases and extra assertions; mtp_checks holds what the MTP heads' tests share (and these use)."""

import asyncio
import json
import shutil

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.jobs import Job, SamplingParams
from provider.memory import estimate
from provider.models import capability
from provider.drafters.dflash.head import load_dflash
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters import registry
from provider.types import SpecMode
from provider.proofs.hidden_tap import model_layers
from tests import mtp_checks
from tests.helpers import collect, greedy, make_node, run


def load_dflash_beside(target, model):
    """The DFlash drafter the fixture factory wrote beside `target` (fixtures.dflash.drafter_dir), loaded for its
    `model`: the DFlash families' tests' load_head."""
    return load_dflash(drafter_dir(target), model)


def caps_with(target, drafter):
    """The target's capabilities with `drafter` configured for it (config + headers only)."""
    config = capability.read_config(target)
    return capability.with_drafter(capability.detect(target, config), target, drafter, config)


def paired_listed_and_registered(target, name: str, drafter, kind: str) -> None:
    """Paired as `kind` from config + headers, listed so (its tag) by the model command, and registered so by a
    node with the drafter configured."""
    from coordinator_client.registration import model_infos
    from provider.commands.model_commands import describe, list_line
    from provider.models.store import StoredModel
    from provider.settings import Settings

    caps = caps_with(target, drafter)
    assert (caps.mtp_capable, caps.speculates_with, caps.drafter_reason) == (True, kind, "ok"), caps
    row = describe(Settings(), StoredModel(name, str(target), target, "configured", drafter=str(drafter)), 1 << 30)
    assert (row["speculates_with"], row["mtp_capable"]) == (kind, True) and list_line(row).endswith(f"  [{kind}]")
    node = make_node({name: target}, manager_kw={"drafters": {name: drafter}})
    registered = {i.id: i.capabilities for i in model_infos(node.status())}[name]
    run(node.stop())
    assert (registered.mtp_capable, registered.speculates_with) == (True, kind)


def broken(drafter, out, config=None, tensors=None, raw=None):
    """A copy of the drafter with its config (a dict in, a dict out), its tensors (likewise) or its file's bytes
    rewritten."""
    shutil.copytree(drafter, out)
    if config:
        (out / "config.json").write_text(json.dumps(config(json.loads((out / "config.json").read_text()))))
    if tensors:
        weights = tensors(dict(mx.load(str(out / "model.safetensors"))))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    if raw:
        (out / "model.safetensors").write_bytes(raw((out / "model.safetensors").read_bytes()))
    return out


def refused(target, bad, why: str) -> None:
    """The drafter at `bad` is refused at capability time, `why` in its reason."""
    caps = caps_with(target, bad)
    assert not caps.mtp_capable and caps.speculates_with == "" and why in caps.drafter_reason, caps


def served_plain(target, name: str, bad) -> None:
    """A node (auto) with the refused drafter `bad` configured serves a job plain (no rounds, reason no_drafter),
    plain decoding's tokens; and a target loaded without a drafter carries no layer tap."""
    prompt, n = train_prompts()[0], 12
    node = make_node({name: target}, speculation="auto", manager_kw={"drafters": {name: bad}})

    async def main():
        try:
            return await collect(node, Job("p", name, greedy(n), prompt_ids=tuple(prompt)))
        finally:
            await node.stop()

    ids, _, done, _ = run(main())
    assert hasattr(done, "telemetry"), done
    spec = done.telemetry.speculation
    assert (spec.rounds, spec.mode.value, spec.reason) == (0, "off", "no_drafter"), spec
    assert ids == mtp_checks.plain(target, prompt, n)
    model, _ = load(str(target))
    assert not any(hasattr(type(layer), "layer_tap") for layer in model_layers(model))


def greedy_as_plain(target, name: str, drafter, n: int = 16):
    """Four distilled prompts and four held out (1 to 90 tokens) whose plain run of n tokens has no end token,
    alone then 8 at once (mtp_checks.greedy_alone_and_together, k = 3): plain decoding's tokens, every job
    speculating, and on the distilled prompts over half the drafts accepted. Returns (alone, together)."""
    _, tok = load(str(target))
    end = set(tok.eos_token_ids)  # the node stops at an end token, mlx-lm's plain decoding here does not
    clean = [(p, w) for p in train_prompts() + mtp_checks.prompts(target)[4:]
             if not end & set(w := mtp_checks.plain(target, p, n))]
    distilled = [c for c in clean if c[0] in train_prompts()][:4]
    ps, want = map(list, zip(*distilled + [c for c in clean if c[0] not in train_prompts()][:4]))
    assert len(ps) == 8
    alone, together, _ = mtp_checks.greedy_alone_and_together(target, name, ps, want, n, drafter=drafter)
    for results in (alone, together):
        spec = [done.telemetry.speculation for _, _, done, _ in results]
        assert sum(s.accepted for s in spec[:4]) > sum(s.drafted for s in spec[:4]) // 2, spec
    return alone, together


def greedy_as_plain_accepted_alone(target, name: str, drafter, n: int = 16) -> None:
    """Four distilled prompts and four held out, alone then 8 at once (k = 3): plain decoding's tokens; alone, over
    half the distilled prompts' drafts accepted. Together their prefixes come from the prefix cache and the drafter's
    context skips them: a tiny drafter that learnt its training sequences drafts those rows poorly (still lossless)."""
    ps = train_prompts()[:4] + mtp_checks.prompts(target)[4:]
    want = [mtp_checks.plain(target, p, n) for p in ps]
    alone, _, _ = mtp_checks.greedy_alone_and_together(target, name, ps, want, n, drafter=drafter)
    spec = [done.telemetry.speculation for _, _, done, _ in alone[:4]]
    assert sum(s.accepted for s in spec) > sum(s.drafted for s in spec) // 2, spec


def sampled_as_plain(target, load_head, drafter_class) -> None:
    """mtp_checks.sampled_as_plain on the first training prompt, with the family's drafter class."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params, drafter=drafter_class)


def weights_and_activations_booked(target, drafter, load_head, family, head_class):
    """The drafter as it loads (a `head_class`) holds `family.weight_bytes` (family: drafters.eagle3.config or
    drafters.dflash.config), and its footprint beyond them is its activations. Returns (target model, head, its config)."""
    config = capability.read_config(drafter)
    model, _ = load(str(target))
    head = load_head(target, model)
    assert isinstance(head, head_class)
    held = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    assert family.weight_bytes(drafter) == held
    assert registry.kind_of(target, drafter, config).footprint(drafter, config, 3, 512) - held == \
        estimate.activation_bytes(family.flat_config(config), 512, attention_only=True)
    return model, head, config


def node_books_the_drafter(target, name: str, drafter, head_class, kv_shape) -> None:
    """Through the residency: the drafter's reservation is its footprint, and the loaded pair's drafter (a
    `head_class`) KV shape is `kv_shape(drafter, config)`."""
    node = make_node({name: target}, speculation="on", speculation_k=3, manager_kw={"drafters": {name: drafter}})

    async def main():
        try:
            await collect(node, Job("b", name, greedy(4), prompt_ids=tuple(train_prompts()[0])))
            entry = node.models._entries[name]
            return entry.drafter_bytes, entry.lm
        finally:
            await node.stop()

    booked, lm = run(main())
    config = capability.read_config(drafter)
    assert booked == registry.kind_of(target, drafter, config).footprint(drafter, config, 3,
                                                                        node.models._prefill_step) > 0
    assert lm.drafter_mode is SpecMode.MTP and isinstance(lm.drafter, head_class)
    assert lm.draft_kv_shape == kv_shape(drafter, config)


def grammar_rows_as_plain_together(target, name: str, drafter) -> None:
    """Two rows under JSON schemas, a free row and a sampled constrained row, speculating together with the
    drafter: each greedy row emits its plain run's tokens, the constrained ones validate, and the free row had drafts
    accepted."""
    import jsonschema

    from provider.constraints import OutputRules, ResponseFormat

    schemas, messages = mtp_checks.JSON_SCHEMAS, mtp_checks.JSON_MESSAGES

    def jobs(tag: str, speculation: str) -> list[Job]:
        return [*(Job(f"{tag}s{i}", name, greedy(48), messages=messages, speculation=speculation,
                      rules=OutputRules(ResponseFormat("json_schema", s, "x"))) for i, s in enumerate(schemas)),
                Job(f"{tag}f", name, greedy(16), prompt_ids=tuple(train_prompts()[0]), speculation=speculation),
                Job(f"{tag}t", name, SamplingParams(max_tokens=48, temperature=0.7), messages=messages,
                    speculation=speculation, rules=OutputRules(ResponseFormat("json_schema", schemas[1], "x")))]

    async def main():
        node = make_node({name: target}, max_concurrent_jobs=4, speculation_k=3,
                         manager_kw={"drafters": {name: drafter}})
        try:
            plain = [await collect(node, j) for j in jobs("off", "off")]
            return plain, await asyncio.gather(*(collect(node, j) for j in jobs("on", "on")))
        finally:
            await node.stop()

    plain, together = run(main())
    for i, ((ids, text, done, _), (want, _, _, _)) in enumerate(zip(together, plain)):
        spec = done.telemetry.speculation
        assert (spec.mode.value, spec.reason) == ("mtp", "ok") and spec.rounds > 0, (i, spec)
        if i < 3:
            assert ids == want, f"job {i}: speculation changed the output"
        if i != 2:  # the sampled row too: its draft distributions are never NaN, all its drafts valid
            jsonschema.validate(json.loads(text), schemas[min(i, 1)])
    assert together[2][2].telemetry.speculation.accepted > 0


def sampled_rows_proposed(target, load_head, drafter_class, k: int = 4):
    """Three sampled rows (temperature 1) of the first training prompts, read and begun, drafting k together in the
    engine's `drafter_class` (a DFlash one). Returns (model, head, drafter, rows, drafts [3, k], qs)."""
    from provider.engine.acceptance import SampledChoice
    from provider.engine.spec_rounds import Speculator
    from provider.models.gemma4_target import Target
    from provider.telemetry import SpecTelemetry

    model, _ = load(str(target))
    head = load_head(target, model)
    drafter = drafter_class(head, Target(model))
    spec = Speculator(model, drafter)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    rows = [spec.new_row(p, stats=SpecTelemetry("s", k=k), choice=SampledChoice(params, i))
            for i, p in enumerate(train_prompts()[:3])]
    for row in rows:
        while not spec.read(row, 2048):
            pass
    spec.begin(rows)
    drafts, qs = drafter.propose(rows, k, [])
    return model, head, drafter, rows, drafts, qs


def mlx_vlm_drafter(drafter, model, family: str, change=None):
    """mlx-vlm's drafter of `family` (a module of mlx_vlm.speculative.drafters) on the checkpoint's weights (its
    config rewritten by `change`), bound to the mlx-lm target `model` by DFlashDraftModel's bind (the families' own
    binds ask the target for mlx-vlm's cache rollback)."""
    import importlib

    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    module = importlib.import_module(f"mlx_vlm.speculative.drafters.{family}")
    config = json.loads((drafter / "config.json").read_text())
    theirs = module.Model(module.ModelConfig.from_dict(change(config) if change else config))
    weights = dict(mx.load(str(drafter / "model.safetensors")))
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=True)
    DFlashDraftModel.bind(theirs, model)
    return theirs
