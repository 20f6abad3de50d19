"""Quantized KV inside the batch (issue 40): the batch cache does what mlx-lm's BatchKVCache does, on the values it
holds; the engine serves a model at kv_bits 8 or 4 through every path (plain batch, scored prompts, MTP and draft
model speculation, the prefix cache, rows joining and leaving), and what it holds is what the ledger books."""

import asyncio
import copy
import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from provider.engine import kv_file
from provider.engine.kv_quant import BatchQuantizedKVCache, QuantizedKVRow, make_caches
from provider.engine.kv_quant_rotating import BatchQuantizedRotatingKVCache, QuantizedRotatingKVRow
from provider.engine.spec_rounds import rollback
from provider.jobs import Job, SamplingParams
from provider.outputs import Done
from provider.memory.batch_kv import plain_batch_bytes
from provider.memory.estimate import KVQuant, kv_shape
from tools.fixtures import factory
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from tests.helpers import collect, greedy, make_node, run

# Echo logprobs at 8 bits stay within this of full precision's, in nats (measured on the demo model: max 0.009 in
# float16, 0.0019 in float32).
ECHO_TOL_8 = 0.05
# Greedy tokens at 8 bits equal to full precision's, at least: issue 40's bar (measured: 99.6 % of 32 x 32 in
# float16, 100 % in float32; at kv_bits 8 the sliding windows stay in full precision,
# memory.estimate.sliding_layer_quant: with them at 8 bits too, 93.3 %).
GREEDY_8 = 0.95
# Past the window at kv_bits 4 (full-attention layers at 4 bits, the windows at 8), at least (measured: 249 of
# 288, 6 rows of 48, in float16 and in float32; one early flip changes the rest of a row).
PAST_WINDOW_4 = 0.8


def _prompts(n: int) -> list[str]:
    """`n` prompts of 6 to 20 words cut from the standard library's docstrings (the demo model was trained on
    installed packages' docstrings and docs: its greedy choices there are not near-ties of a random model)."""
    import functools, json as js, pathlib, shutil as sh, textwrap

    words = " ".join(getattr(f, "__doc__", "") or "" for m in (js, textwrap, functools, pathlib, sh)
                     for f in vars(m).values() if callable(f)).split()
    return [" ".join(words[(997 * i) % (len(words) - 20):][: 6 + (i * 5) % 15]) for i in range(n)]


# --- the cache alone -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_batch_ops_equal_batchkvcache_on_the_values_they_hold(bits, group):
    """Each operation, on a BatchKVCache fed the dequantized K/V and on the quantized batch: the same positions,
    offsets, padding and masks, and the same values once dequantized."""
    mx.random.seed(1)
    H, D = 2, 64

    def dq(t):
        return mx.dequantize(*t, group_size=group, bits=bits)

    def kv(rows: int, n: int):
        k, v = mx.random.normal((rows, H, n, D)), mx.random.normal((rows, H, n, D))
        return (k, v), (dq(mx.quantize(k, group_size=group, bits=bits)), dq(mx.quantize(v, group_size=group, bits=bits)))

    def same(q: BatchQuantizedKVCache, f: BatchKVCache):
        (qk, qv), (fk, fv) = q.keys_and_values(), f.keys_and_values()
        assert qk[0].shape[2] == fk.shape[2] and q.size() == f.size()
        assert mx.array_equal(dq(qk), fk) and mx.array_equal(dq(qv), fv)
        assert q.offset.tolist() == f.offset.tolist() and q.left_padding.tolist() == f.left_padding.tolist()
        for n in (1, 3):
            assert mx.array_equal(q.make_mask(n), f.make_mask(n))

    rows_q, rows_f = [], []
    for n in (5, 9, 0):  # an empty row among them
        rq, rf = QuantizedKVRow(group, bits), KVCache()
        if n:
            exact, seen = kv(1, n)
            rq.update_and_fetch(*exact)
            rf.update_and_fetch(*seen)
        rows_q.append(rq)
        rows_f.append(rf)
    bq, bf = QuantizedKVRow.merge(rows_q), KVCache.merge(rows_f)
    assert isinstance(bq, BatchQuantizedKVCache) and bq.bits == bits and bq.group_size == group
    same(bq, bf)

    # Prompts of three lengths read right-padded in one forward, then rolled to the left (finalize).
    pq, pf = QuantizedKVRow.merge([QuantizedKVRow(group, bits)] * 3), KVCache.merge([KVCache()] * 3)
    for c in (pq, pf):
        c.prepare(lengths=[4, 2, 3], right_padding=[0, 2, 1])
    exact, seen = kv(3, 4)
    pq.update_and_fetch(*exact)
    pf.update_and_fetch(*seen)
    for c in (pq, pf):
        c.finalize()
    same(pq, pf)
    for _ in range(260):  # past a 256-position step: both grow alike
        exact, seen = kv(3, 1)
        pq.update_and_fetch(*exact)
        pf.update_and_fetch(*seen)
    same(pq, pf)
    assert pq.keys[0].shape[2] == pf.keys.shape[2] == 512

    bq.extend(pq)  # rows joining
    bf.extend(pf)
    same(bq, bf)
    bq.filter([1, 3, 5])  # rows leaving
    bf.filter([1, 3, 5])
    same(bq, bf)
    for i in range(3):
        eq, ef = bq.extract(i), bf.extract(i)
        assert isinstance(eq, QuantizedKVRow) and eq.offset == ef.offset == eq.size()
        assert mx.array_equal(dq(eq.keys), ef.keys) and eq.nbytes == sum(a.nbytes for a in (*eq.keys, *eq.values))
    assert bq.trim(3) == bf.trim(3) == 3
    same(bq, bf)
    again = copy.deepcopy(bq)  # mlx-lm's prompt batch copies its caches so
    same(again, bf)
    ratio = bq.nbytes / bf.nbytes
    assert ratio == pytest.approx((bits / 8 + 2 * 4 / group) / 4)  # float32 K/V: packed plus a scale and a bias


def test_a_full_precision_row_joins_a_quantized_batch_quantized():
    k = mx.random.normal((1, 1, 7, 64))
    full, quant = KVCache(), QuantizedKVRow(64, 8)
    full.update_and_fetch(k, k)
    quant.update_and_fetch(k[..., :3, :], k[..., :3, :])
    batch = QuantizedKVRow.merge([quant, full])
    assert batch.keys[0].shape[2] == 7 and batch.left_padding.tolist() == [4, 0]


class _Twins:
    """The same operations on a quantized sliding cache, on mlx-lm's full-precision one fed the dequantized K/V
    (they must agree exactly) and on mlx-lm's fed the exact K/V (they must agree within quantization error)."""

    H, D = 2, 64

    def __init__(self, bits: int, group: int, caches: tuple):
        self.bits, self.group = bits, group
        self.q, self.seen, self.exact = caches

    def dq(self, t):
        return mx.dequantize(*t, group_size=self.group, bits=self.bits)

    def feed(self, rows: int, n: int):
        k, v = mx.random.normal((rows, self.H, n, self.D)), mx.random.normal((rows, self.H, n, self.D))
        fake = [self.dq(mx.quantize(x, group_size=self.group, bits=self.bits)) for x in (k, v)]
        for c, kv in ((self.q, (k, v)), (self.seen, fake), (self.exact, (k, v))):
            c.update_and_fetch(*kv)
        self.check()

    def do(self, name: str, *args):
        out = [getattr(c, name)(*args) for c in (self.q, self.seen, self.exact)]
        self.check()
        return out

    def check(self):
        q, f, e = self.q, self.seen, self.exact
        (qk, qv), (fk, fv), (ek, ev) = q.keys_and_values(), f.keys_and_values(), e.keys_and_values()
        assert qk[0].shape[2] == fk.shape[2] and q.size() == f.size()
        assert mx.array_equal(self.dq(qk), fk) and mx.array_equal(self.dq(qv), fv)
        # The exact K/V within quantization error: half a step of a group's range (normal values: under 16).
        tol = 8 / (2 ** self.bits - 1)
        assert mx.abs(self.dq(qk) - ek).max().item() <= tol and mx.abs(self.dq(qv) - ev).max().item() <= tol
        for attr in ("offset", "left_padding", "_idx", "_offset", "rotated", "keep"):
            if hasattr(f, attr):
                a, b = getattr(q, attr), getattr(f, attr)
                assert (a.tolist() if isinstance(a, mx.array) else a) == (b.tolist() if isinstance(b, mx.array)
                                                                         else b), attr
        for n in (1, 3):
            qm, fm = q.make_mask(n, window_size=q.max_size), f.make_mask(n, window_size=f.max_size)
            assert (qm is None and fm is None) or isinstance(qm, str) and qm == fm or mx.array_equal(qm, fm)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_rotating_batch_ops_equal_batchrotatingkvcache_past_the_window(bits, group):
    """mlx-lm's BatchRotatingKVCache and the quantized one through the generator's and the speculative rounds'
    operations, past an 8-position window: rows merged (one past its window and rotated, one short, one empty),
    right-padded prompts read in two chunks and finalized, width-1 steps that rotate, width-3 verify steps, rows
    joining in another rotation state, rows leaving, rows extracted and merged again, a trim; the same positions,
    offsets, padding and masks throughout, the same values once dequantized, the exact K/V within quantization
    error."""
    mx.random.seed(2)
    W = 8

    def rows(n):
        t = _Twins(bits, group, (QuantizedRotatingKVRow(W, 0, group, bits), RotatingKVCache(W), RotatingKVCache(W)))
        if n:
            t.feed(1, n)
        for _ in range(max(0, n - 10)):  # width-1 steps past the window: rotated
            t.feed(1, 1)
        return t

    parts = [rows(n) for n in (5, 13, 0)]

    def merged(parts):
        caches = [[getattr(t, a) for t in parts] for a in ("q", "seen", "exact")]
        return _Twins(bits, group, tuple(c[0].merge(c) for c in caches))

    b = merged(parts)
    assert isinstance(b.q, BatchQuantizedRotatingKVCache) and (b.q.bits, b.q.group_size) == (bits, group)
    assert isinstance(b.seen, BatchRotatingKVCache)
    b.check()
    for _ in range(W + 3):
        b.feed(3, 1)
    assert b.q.rotated

    p = merged([rows(0) for _ in range(3)])  # three prompts of 10, 4 and 7 tokens, right-padded, two chunks
    for c in (p.q, p.seen, p.exact):
        c.prepare(lengths=[10, 4, 7], right_padding=[0, 6, 3])
    p.feed(3, 6)
    p.feed(3, 4)
    p.do("finalize")
    for _ in range(5):
        p.feed(3, 1)

    for x, y in ((b.q, p.q), (b.seen, p.seen), (b.exact, p.exact)):  # rows joining, in another rotation state
        x.extend(y)
    b.check()
    b.feed(6, 3)  # a verify step (width 3)
    b.feed(6, 1)
    b.do("filter", [1, 3, 5])
    for _ in range(W):
        b.feed(3, 1)
    out = [b.do("extract", i) for i in range(3)]
    for q, f, e in out:
        assert isinstance(q, QuantizedRotatingKVRow) and q.offset == f.offset and q._idx == f._idx
        assert q.nbytes == sum(a.nbytes for a in (*q.keys, *q.values))
    again = merged([_Twins(bits, group, tuple(t)) for t in out])
    again.feed(3, 1)
    assert b.do("trim", 2)[0] == 2
    twin = copy.deepcopy(b.q)  # mlx-lm's prompt batch copies its caches so
    assert mx.array_equal(b.dq(twin.keys), b.seen.keys)
    ratio = b.q.nbytes / b.seen.nbytes
    assert ratio == pytest.approx((bits / 8 + 2 * 4 / group) / 4)  # float32 K/V: packed plus a scale and a bias


def test_a_quantized_sliding_row_rolls_back_and_travels_as_mlx_lms():
    """One sequence past its window: chunks, width-1 steps, a width-4 verify step rolled back by the speculative
    rounds' rollback and decoded on; the same as mlx-lm's RotatingKVCache on the values. Its state is written to
    a prefix-cache file and read back, and it joins a batch."""
    mx.random.seed(3)
    t = _Twins(8, 64, (QuantizedRotatingKVRow(8, 0, 64, 8), RotatingKVCache(8), RotatingKVCache(8)))
    t.feed(1, 6)
    for _ in range(5):
        t.feed(1, 1)
    t.feed(1, 4)
    rollback([t.q, t.seen, t.exact], 3)
    t.check()
    for _ in range(9):
        t.feed(1, 1)
    mx.eval(t.q.state)
    scope, key, tokens = bytes(32), bytes(range(32)), list(range(t.q.offset))  # a file's tokens: its offset's
    _, (back,) = kv_file.decode(kv_file.encode(scope, tokens, [t.q], key), scope, key, kv_file.of_caches([t.q]))
    assert type(back) is QuantizedRotatingKVRow and back.state[2:] == t.q.state[2:]
    assert all(mx.array_equal(a, b) for a, b in zip((*back.keys, *back.values), (*t.q.keys, *t.q.values)))
    full = RotatingKVCache(8)  # a full-precision row joins a quantized batch quantized
    full.update_and_fetch(*(mx.random.normal((1, 2, 3, 64)),) * 2)
    batch = QuantizedRotatingKVRow.merge([back, full])
    assert isinstance(batch, BatchQuantizedRotatingKVCache) and batch.left_padding.tolist() == [0, 5]


def test_sliding_layers_are_quantized_below_8_bits_and_booked_so():
    """The demo model's sliding-window layers keep full precision at kv_bits 8 and get 8-bit quantized caches at
    kv_bits 4 (they stayed in full precision before), and kv_shape books each as it is stored."""
    from mlx_lm import load
    from mlx_lm.models.cache import RotatingKVCache

    model, _ = load(str(DEMO_TARGET))
    config = json.loads((DEMO_TARGET / "config.json").read_text())
    full = kv_shape(config, 2)

    def per(b):  # fp16: packed plus a scale and a bias per 64 elements
        return (b / 8 + 2 * 2 / 64) / 2

    for bits, window in ((8, RotatingKVCache), (4, QuantizedRotatingKVRow)):
        caches = make_caches(model, config, KVQuant(bits, 64))
        assert [type(c) for c in caches] == [window, window, QuantizedKVRow, window]
        quant = kv_shape(config, 2, KVQuant(bits, 64))
        assert quant.bytes_per_token_full == pytest.approx(per(bits) * full.bytes_per_token_full)
        window_share = 1.0 if bits == 8 else per(8)
        assert quant.bytes_per_token_sliding == pytest.approx(window_share * full.bytes_per_token_sliding)
    assert [(c.bits, c.group_size) for c in make_caches(model, config, KVQuant(4, 64))] == [(8, 64), (8, 64), (4, 64),
                                                                                          (8, 64)]


def test_the_ledger_books_what_a_quantized_batch_holds():
    """The demo model's caches at 4 bits, three rows read to 300 tokens: what they hold (full-attention and
    sliding-window layers quantized) is at most what plain_batch_bytes books, and most of it."""
    from mlx_lm import load

    model, _ = load(str(DEMO_TARGET))
    config = json.loads((DEMO_TARGET / "config.json").read_text())
    quant = KVQuant(4, 64)
    rows = [make_caches(model, config, quant) for _ in range(3)]
    assert {type(c) for c in rows[0]} == {QuantizedKVRow, QuantizedRotatingKVRow}
    batch = [layer[0].merge(list(layer)) for layer in zip(*rows)]
    model(mx.array([[7] * 299] * 3), cache=batch)
    model(mx.array([[7]] * 3), cache=batch)
    held = sum(c.nbytes for c in batch)
    booked = plain_batch_bytes([300] * 3, kv_shape(config, 2, quant))
    assert 0.85 * booked <= held <= booked, (held, booked)


# --- through the engine ----------------------------------------------------------------------------------------


def _serve(pair: tuple, bits: int, jobs: list[Job], **settings) -> list:
    """`jobs` on (target, assistant) at `bits`: the demo pair in float32 (conftest's demo_f32) where a test reads
    the engine's output, the shipped one where it reads the model's files or timing."""
    target, assistant = pair
    node = make_node({"d": target}, manager_kw={"kv_bits": bits, "drafters": {"d": assistant}},
                     **({"max_concurrent_jobs": 16, "speculation": "off"} | settings))

    async def main():
        out = await asyncio.gather(*(collect(node, j) for j in jobs))
        await node.stop()
        return out

    return run(main())


def test_greedy_and_echo_at_8_bits_match_full_precision_on_the_demo_model(demo_f32):
    """32 prompts, 32 greedy tokens each, and four scored prompts (echo), at full precision and 8 bits (4 bits'
    figures are tools/bench/bench_kv_quant.py's: the suite has no bar for them here)."""
    prompts = _prompts(32)
    jobs = [Job(f"g{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)]
    jobs += [Job(f"e{i}", "d", SamplingParams(max_tokens=0, temperature=0.0, logprobs=1, prompt_logprobs=True),
                 prompt=" ".join(prompts[i::8])) for i in range(4)]
    runs = {bits: _serve(demo_f32, bits, jobs) for bits in (0, 8)}
    base = runs[0]
    for bits, out in runs.items():
        assert all(isinstance(end, Done) for _, _, end, _ in out)
        same = sum(a == b for (x, _, _, _), (y, _, _, _) in zip(base[:32], out[:32]) for a, b in zip(x, y))
        total = sum(len(x) for x, _, _, _ in base[:32])
        diffs = [abs(a.logprob - b.logprob) for (_, _, x, _), (_, _, y, _) in zip(base[32:], out[32:])
                 for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
        print(f"kv_bits {bits}: greedy tokens equal to full precision {same}/{total} ({same / total:.3f}); "
              f"echo logprob |diff| max {max(diffs):.4f} mean {sum(diffs) / len(diffs):.4f} over {len(diffs)}")
        if bits == 8:
            assert same >= GREEDY_8 * total
            assert max(diffs) <= ECHO_TOL_8


def test_greedy_past_the_sliding_window_at_4_bits_stays_close_to_full_precision(demo_f32):
    """Prompts of about 150 to 250 tokens and 48 greedy tokens each, so the demo model's sliding-window layers
    (window 128; at kv_bits 4 quantized at 8 bits) hold only the window: most tokens equal full precision's."""
    text = " ".join(_prompts(60))
    jobs = [Job(f"w{i}", "d", greedy(48), prompt=text[300 * i:][: 700 + 120 * i]) for i in range(6)]
    base, out = _serve(demo_f32, 0, jobs), _serve(demo_f32, 4, jobs)
    assert all(isinstance(end, Done) for _, _, end, _ in out)
    assert min(end.usage.prompt_tokens for _, _, end, _ in out) > 128
    same = sum(a == b for (x, _, _, _), (y, _, _, _) in zip(base, out) for a, b in zip(x, y))
    total = sum(len(x) for x, _, _, _ in base)
    print(f"past the window, kv_bits 4: greedy tokens equal to full precision {same}/{total}")
    assert same >= PAST_WINDOW_4 * total


def test_speculation_with_the_assistant_reads_the_quantized_target_kv(demo_f32):
    """MTP speculation over a quantized target cache gives exactly the tokens plain decoding gives at the same
    precision (the assistant attends to the quantized K/V of the target's last full and last sliding layer); one
    prompt passes the 128-token window."""
    prompts = _prompts(3)
    prompts[0] = " ".join(_prompts(40))[:800]
    plain = _serve(demo_f32, 4, [Job(f"p{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)])
    spec = _serve(demo_f32, 4, [Job(f"s{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)],
                  speculation="on")
    for (x, _, _, _), (y, _, end, _) in zip(plain, spec):
        assert end.telemetry.speculation.mode == "mtp" and end.telemetry.speculation.accepted > 0
        assert x == y


def test_speculation_with_a_draft_model_over_quantized_target_kv(tmp_path, fixtures_dir):
    """A Llama target with 32-wide heads (quantized in groups of 32) and the fixture's draft model (its own KV in
    full precision): speculating rows equal plain ones at the same precision."""
    target = tmp_path / "llama-32"
    shutil.copytree(fixtures_dir / "llama-tiny", target)
    config = json.loads((target / "config.json").read_text()) | {"hidden_size": 128, "head_dim": 32}
    (target / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(target / "model.safetensors"), factory._random_weights(config, seed=2))
    prompts = ["The cache holds a window", "batch token prompt model", "memory budget stream"]

    def serve(spec: str):
        node = make_node({"t": target}, manager_kw={"kv_bits": 8, "drafters": {"t": fixtures_dir / "llama-tiny-draft"}},
                         max_concurrent_jobs=4, speculation=spec)

        async def main():
            out = await asyncio.gather(*(collect(node, Job(f"j{i}", "t", greedy(24), prompt=p))
                                         for i, p in enumerate(prompts)))
            await node.stop()
            return out

        return run(main())

    plain, spec = serve("off"), serve("on")
    for (x, _, _, _), (y, _, end, _) in zip(plain, spec):
        assert end.telemetry.speculation.mode == "draft" and end.telemetry.speculation.rounds > 0
        assert x == y


def test_prefix_reuse_and_rows_joining_and_leaving_with_quantized_kv():
    """At 4 bits (every layer quantized): a prompt extending a served one reuses its quantized KV from the prefix
    cache and decodes as a fresh node does; rows that join a decoding batch, leave it early (short max_tokens) or
    are cancelled leave every other row's tokens as they are alone."""
    node = make_node({"d": DEMO_TARGET}, manager_kw={"kv_bits": 4}, max_concurrent_jobs=8, speculation="off")
    prompts = _prompts(8)
    long = " ".join(prompts[:4])

    async def main():
        first = await collect(node, Job("a", "d", greedy(8), prompt=long))
        again = await collect(node, Job("b", "d", greedy(24), prompt=long + " and more"))
        solo = [await collect(node, Job(f"s{i}", "d", greedy(8 + 4 * i), prompt=p)) for i, p in enumerate(prompts)]
        early = [asyncio.ensure_future(collect(node, Job(f"m{i}", "d", greedy(8 + 4 * i), prompt=p)))
                 for i, p in enumerate(prompts[:4])]
        await asyncio.sleep(0.3)  # the first rows decode; the rest join them
        late = [asyncio.ensure_future(collect(node, Job(f"m{i}", "d", greedy(8 + 4 * i), prompt=p)))
                for i, p in enumerate(prompts[4:], 4)]
        cancelled = asyncio.ensure_future(collect(node, Job("x", "d", greedy(200), prompt=prompts[0])))
        await asyncio.sleep(0.2)
        node.cancel("x")
        mixed = await asyncio.gather(*early, *late)
        await cancelled
        hits = node.status().queue
        await node.stop()
        return first, again, solo, mixed, hits

    first, again, solo, mixed, queue = run(main())
    assert again[2].usage.cached_prompt_tokens > 0 and queue.prefix_hits >= 1
    fresh = _serve((DEMO_TARGET, DEMO_ASSISTANT), 4, [Job("b", "d", greedy(24), prompt=long + " and more")],
                   prefix_cache_gb=0)
    assert again[0] == fresh[0][0]
    for (x, _, _, _), (y, _, _, _) in zip(solo, mixed):
        assert x == y
