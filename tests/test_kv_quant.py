"""Quantized KV inside the batch (issue 40): the batch cache does what mlx-lm's BatchKVCache does, on the values it
holds; the engine serves a model at kv_bits 8 or 4 through every path (plain batch, scored prompts, MTP and draft
model speculation, the prefix cache, rows joining and leaving), and what it holds is what the ledger books."""

import asyncio
import copy
import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from provider.engine.kv_quant import BatchQuantizedKVCache, QuantizedKVRow, make_caches
from provider.jobs import Done, Job, SamplingParams
from provider.memory.batch_kv import plain_batch_bytes
from provider.memory.estimate import KVQuant, kv_shape
from provider.models import fixtures
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from tests.helpers import collect, greedy, make_node, run

# Echo logprobs at 8 bits stay within this of full precision's, in nats (measured on the demo model: max 0.012, mean
# 0.001 over 355 positions; at 4 bits max 0.055, mean 0.006).
ECHO_TOL_8 = 0.05


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


def test_the_ledger_books_what_a_quantized_batch_holds():
    """The demo model's caches at 4 bits, three rows read to 300 tokens: what they hold (full-attention layers
    quantized, sliding ones in full precision) is at most what plain_batch_bytes books, and most of it."""
    from mlx_lm import load

    model, _ = load(str(DEMO_TARGET))
    config = json.loads((DEMO_TARGET / "config.json").read_text())
    quant = KVQuant(4, 64)
    rows = [make_caches(model, config, quant) for _ in range(3)]
    assert {type(c) for c in rows[0]} == {QuantizedKVRow, RotatingKVCache}
    batch = [layer[0].merge(list(layer)) for layer in zip(*rows)]
    model(mx.array([[7] * 299] * 3), cache=batch)
    model(mx.array([[7]] * 3), cache=batch)
    held = sum(c.nbytes for c in batch)
    booked = plain_batch_bytes([300] * 3, kv_shape(config, 2, quant))
    assert 0.85 * booked <= held <= booked, (held, booked)


# --- through the engine ----------------------------------------------------------------------------------------


def _serve(bits: int, jobs: list[Job], **settings) -> list:
    node = make_node({"d": DEMO_TARGET}, manager_kw={"kv_bits": bits, "drafters": {"d": DEMO_ASSISTANT}},
                     **({"max_concurrent_jobs": 16, "speculation": "off"} | settings))

    async def main():
        out = await asyncio.gather(*(collect(node, j) for j in jobs))
        await node.stop()
        return out

    return run(main())


def test_greedy_and_echo_at_8_bits_match_full_precision_on_the_demo_model():
    """32 prompts, 32 greedy tokens each, and four scored prompts (echo), at full precision, 8 and 4 bits."""
    prompts = _prompts(32)
    jobs = [Job(f"g{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)]
    jobs += [Job(f"e{i}", "d", SamplingParams(max_tokens=0, temperature=0.0, logprobs=1, prompt_logprobs=True),
                 prompt=" ".join(prompts[i::8])) for i in range(4)]
    runs = {bits: _serve(bits, jobs) for bits in (0, 8, 4)}
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
            assert same >= 0.95 * total
            assert max(diffs) <= ECHO_TOL_8


def test_speculation_with_the_assistant_reads_the_quantized_target_kv():
    """MTP speculation over a quantized target cache gives exactly the tokens plain decoding gives at the same
    precision (the assistant attends to the quantized K/V of the target's last full layer, and to the sliding
    layer's full-precision K/V); one prompt passes the 128-token window."""
    prompts = _prompts(3)
    prompts[0] = " ".join(_prompts(40))[:800]
    plain = _serve(8, [Job(f"p{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)])
    spec = _serve(8, [Job(f"s{i}", "d", greedy(32), prompt=p) for i, p in enumerate(prompts)], speculation="on")
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
    mx.save_safetensors(str(target / "model.safetensors"), fixtures._random_weights(config, seed=2))
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
    """At 8 bits: a prompt extending a served one reuses its quantized KV from the prefix cache and decodes as a
    fresh node does; rows that join a decoding batch, leave it early (short max_tokens) or are cancelled leave
    every other row's tokens as they are alone."""
    node = make_node({"d": DEMO_TARGET}, manager_kw={"kv_bits": 8}, max_concurrent_jobs=8, speculation="off")
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
    fresh = _serve(8, [Job("b", "d", greedy(24), prompt=long + " and more")], prefix_cache_gb=0)
    assert again[0] == fresh[0][0]
    for (x, _, _, _), (y, _, _, _) in zip(solo, mixed):
        assert x == y
