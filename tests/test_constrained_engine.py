"""Constrained decoding inside the engine: rows under different grammars share a batch exactly, speculation
under a grammar is lossless (greedy token for token, sampled in distribution), and the grammar's work shows
in telemetry. In-process nodes on the bundled demo pair (in float32) and the fixture pair."""

import asyncio
import json
import threading

import jsonschema
import numpy as np
import pytest
from mlx_lm import load

from provider.constraints import OutputRules, ResponseFormat, Tool, ToolChoice
from provider.engine.proposers import DraftModelDrafter
from provider.engine.grammar import GrammarError, RowGrammar
from provider.engine.grammar_compile import Compiler
from provider.jobs import Job, SamplingParams
from provider.outputs import Done
from provider.types import Cause
from tests.helpers import collect, make_node, run
from tools.harness.distribution import AcceptEveryDraft, compare, plain_samples, speculative_samples

MODEL = "gemma4-demo"
ITEM = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "kind": {"enum": ["capital", "town", "village"]}},
     "required": ["name", "kind"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "maxItems": 3},
                                      "paid": {"type": "boolean"}}, "required": ["items", "paid"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "note": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}},
     "required": ["score"]},
]
WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}, "The forecast for a city")
MESSAGES = ({"role": "user", "content": "Describe a place as JSON."},)


def _schema_rules(schema: dict) -> OutputRules:
    return OutputRules(ResponseFormat("json_schema", schema, "place"))


def _forced_call() -> OutputRules:
    return OutputRules(tools=(WEATHER,), tool_choice=ToolChoice("function", "get_weather"))


def _job(job_id: str, rules: OutputRules | None, max_tokens: int = 160, **kw) -> Job:
    return Job(job_id, MODEL, SamplingParams(max_tokens=max_tokens, temperature=0.0), messages=MESSAGES,
               rules=rules or OutputRules(), **kw)


def test_a_batch_of_eight_half_constrained_equals_each_solo_run(demo_f32):
    """Four rows under three schemas and a forced call, four free rows, in one batch: each row's tokens are
    those of its run alone, every constrained one validates, and the grammar's cost is reported (the demo model
    in float32: conftest's demo_f32)."""
    node = make_node({MODEL: demo_f32[0]}, max_concurrent_jobs=8, speculation="off")
    rules = [_schema_rules(s) for s in SCHEMAS] + [_forced_call()] + [None] * 4

    async def main():
        alone = [await collect(node, _job(f"solo{i}", r)) for i, r in enumerate(rules)]
        before = node.status().queue
        together = await asyncio.gather(*(collect(node, _job(f"row{i}", r)) for i, r in enumerate(rules)))
        for i, ((ids, text, done, events), (solo_ids, _, _, _)) in enumerate(zip(together, alone)):
            assert ids == solo_ids, f"row {i} diverged from its run alone"
            assert isinstance(done, Done) and (i >= 4 or done.finish_reason in ("stop", "tool_calls")), (i, done)
            if i < 3:
                jsonschema.validate(json.loads(text), SCHEMAS[i])
                assert done.telemetry.constraint == "json_schema" and done.telemetry.mask_ms_per_token > 0
            elif i == 3:
                calls = [c for e in events if hasattr(e, "tool_calls") for c in e.tool_calls]
                assert done.finish_reason == "tool_calls" and [c.name for c in calls] == ["get_weather"]
                jsonschema.validate(json.loads(calls[0].arguments), WEATHER.parameters)
            else:
                assert done.telemetry.constraint is None
        q = node.status().queue
        rows, steps = q.batch_rows - before.batch_rows, q.batch_steps - before.batch_steps
        assert rows / steps > 2, (rows, steps)  # they really decoded together
        await node.stop()

    run(main())


def test_constrained_greedy_speculation_is_token_identical_to_constrained_plain_decoding(demo_f32):
    """The bundled pair (in float32) with speculation on: schemas and a forced call give the same tokens as plain
    decoding, with drafts proposed under the grammar (accepted often) and rounds really run."""
    target, assistant = demo_f32
    node = make_node({MODEL: target}, manager_kw={"drafters": {MODEL: assistant}}, max_concurrent_jobs=4)

    async def main():
        for i, rules in enumerate([*(_schema_rules(s) for s in SCHEMAS), _forced_call()]):
            spec = await collect(node, _job(f"on{i}", rules, speculation="on"))
            plain = await collect(node, _job(f"off{i}", rules, speculation="off"))
            assert spec[0] == plain[0], f"rules {i}: speculation changed the constrained output"
            t = spec[2].telemetry.speculation
            assert t.mode == "mtp" and t.rounds > 0 and t.accepted > 0, t
        await node.stop()

    run(main())


@pytest.mark.parametrize("control", [False, True])
def test_constrained_sampled_speculation_is_distributed_as_constrained_plain_sampling(fixtures_dir, control):
    """The fixture pair under a grammar of lowercase words, T = 0.7, top_k 64, k = 3, 800 samples a side: a
    chi-square test does not tell speculative sampling (p and q both masked) from the plain sampler under the
    same masks; the biased control (accept every draft) is told apart."""
    model, tok = load(str(fixtures_dir / "llama-tiny"))
    draft, _ = load(str(fixtures_dir / "llama-tiny-draft"))
    compiler = Compiler(tok, 512)
    lark = "start: /[a-z ]{1,40}/"

    def grammar():
        return RowGrammar(compiler.matcher(lark, "response_format"), 512, 512, set(tok.eos_token_ids), "lark")

    prompt = tok.encode("The cache")
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=64, seed=3)
    plain = plain_samples(model, prompt, params, 800, 5, grammar=grammar)
    ends = set(tok.eos_token_ids)
    for sample in plain[:50]:  # the grammar's words, then its end
        assert tok.decode([t for t in sample if t not in ends]).replace(" ", "").isalpha()
    n, choice = (800, None) if not control else (200, AcceptEveryDraft)
    spec, stats = speculative_samples(model, lambda: DraftModelDrafter(draft), prompt, params, n, 5, k=3,
                                      grammar=grammar, **({"choice": choice} if choice else {}))
    rows = compare(plain, spec, 5)
    if control:
        assert min(r["p"] for r in rows) < 1e-3, rows  # the test has the power to see a bias
    else:
        assert 0.05 < stats.accepted / stats.judged < 0.95
        assert all(r["p"] >= 1e-3 for r in rows), rows


# --- a grammar's failures, typed; `auto` free until a call begins (issue 37) ----------------------------------

def _compiler(fixtures_dir, **limits):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(fixtures_dir / "llama-tiny")
    return tok, Compiler(tok, 512, limits)


def _one(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def test_a_bound_reached_computing_a_mask_fails_the_row_naming_its_field_never_a_stop(fixtures_dir):
    """llguidance out of its step bound while computing a mask allows only its EOS and says it stopped: that is
    the row's GrammarError (invalid_request, naming the field), never an end of the output."""
    tok, compiler = _compiler(fixtures_dir, step_max_items=40)
    row = RowGrammar(compiler.matcher('start: "a" x\nx: x x | "b"', "response_format"), 512, 512,
                     set(tok.eos_token_ids), "json_schema")
    b, ends = _one(tok, "b"), sorted(tok.eos_token_ids)
    row.consume([_one(tok, "a")])
    for _ in range(200):  # as the engine samples: "b" while the mask allows it, else an end (the row ends)
        allowed = row.allowed()
        if row.error is not None:
            break
        row.consume([b] if allowed[b] else ends[:1])
    assert isinstance(row.error, GrammarError), "the matcher's error went unseen: the row ended as if done"
    assert row.error.cause == Cause.INVALID_REQUEST and row.error.param == "response_format"
    assert "Too many items" in row.error.message
    with pytest.raises(GrammarError):
        row.check()


def test_what_the_node_got_wrong_is_the_nodes_error_not_the_requests(fixtures_dir):
    """An empty mask (the grammar's tokens are past the logits' columns) and a token the mask allowed that the
    matcher refuses are the node's failures: internal, not blamed on the request."""
    tok, compiler = _compiler(fixtures_dir)
    narrow = RowGrammar(compiler.matcher('start: "zebra"', "response_format"), 512, 8, set(tok.eos_token_ids),
                        "json_schema")
    narrow.allowed()
    assert narrow.error is not None and narrow.error.cause == Cause.INTERNAL and narrow.error.param is None
    row = RowGrammar(compiler.matcher('start: "a"', "response_format"), 512, 512, set(tok.eos_token_ids), "lark")
    row.consume([_one(tok, "b")])
    assert row.error is not None and row.error.cause == Cause.INTERNAL


def test_the_compile_bound_counts_the_compile_not_its_wait_for_the_worker(fixtures_dir, monkeypatch):
    """A schema that compiles at once is not refused for the time it waited behind another job's compile."""
    from provider.engine import grammar_compile

    monkeypatch.setattr(grammar_compile, "COMPILE_TIMEOUT_S", 0.3)
    tok, compiler = _compiler(fixtures_dir)
    release = threading.Event()
    compiler._pool.submit(release.wait)  # another job's compile holds the one worker
    threading.Timer(0.9, release.set).start()  # for three times the bound
    m = compiler.matcher('start: "a"', "response_format")
    assert release.is_set() and not m.is_error()


AUTO_TOOL = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                 "required": ["city", "days"]})


@pytest.mark.parametrize("fmt_name", ["minicpm5", "kimi_k3", "json_tools"])
def test_auto_is_free_until_the_opening_marker_then_held_to_the_call_then_free(tmp_path, fmt_name):
    """A text marker (minicpm5's `<function name=`), one of several special tokens (kimi_k3) or one special
    token (json_tools): no mask (special tokens pass) until the output holds the marker, however it is cut
    into tokens; the call's grammar from there to its end, and free again after it. A speculative round that
    crossed the marker is rolled back to free."""
    from mlx_lm.utils import load_tokenizer

    from provider.engine.grammar_compile import compile_rules
    from provider.engine.tool_calls import ToolCallSplitter
    from tools.fixtures.tool_formats import make_tool_format
    from provider.models.tool_format import tool_format_for

    make_tool_format(tmp_path / fmt_name, fmt_name)
    tok = load_tokenizer(tmp_path / fmt_name)
    fmt = tool_format_for(tok)
    rules = OutputRules(tools=(AUTO_TOOL,), tool_choice=ToolChoice("auto"))
    lazy = compile_rules(Compiler(tok, 512), rules, fmt)
    ends = set(tok.eos_token_ids)
    row = RowGrammar(lazy, 512, 512, ends, "tools_auto")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    lead = [im_start] + tok.encode("Let me see. ", add_special_tokens=False)
    marker = tok.encode(fmt.start, add_special_tokens=False)
    row.consume(lead)
    assert row.free and row.allowed().all()  # a special token in free text is no error
    row.drafted(marker[0]), [row.drafted(t) for t in marker[1:]]
    assert not row.free  # inside a call, within the drafts
    row.settle([])  # the round kept nothing: back to free text, the matcher as before
    assert row.free and row.allowed().all()
    for t in marker[:-1]:
        row.consume([t])
        assert row.free
    row.consume(marker[-1:])
    assert not row.free and not row.allowed().all()  # the marker is whole: the call is held
    out = list(marker)
    for _ in range(300):  # the first token each mask allows (never an end): the call to its close
        allowed = [int(t) for t in np.flatnonzero(row.allowed()) if t not in ends]
        row.consume(allowed[-1:])
        out += allowed[-1:]
        if row.free:
            break
    assert row.free and row.error is None, tok.decode(out)
    splitter = ToolCallSplitter(fmt, [AUTO_TOOL.as_openai()])
    content, calls = splitter.feed(tok.decode(out))
    rest, more = splitter.finish()
    calls = [*calls, *more]
    assert [c.name for c in calls] == ["get_weather"] and not (content + rest).strip(), tok.decode(out)
    jsonschema.validate(json.loads(calls[0].arguments), AUTO_TOOL.parameters)
