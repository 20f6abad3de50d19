"""The memory ledger against what MLX really holds (`mx.get_active_memory()`), on the fixture factory's
KV-heavy Llama (8 KiB of KV per token, so KV dominates).

MLX's active memory is process-wide, so a node whose books are checked against it runs in a process of its own
(tools.harness.isolated), where nothing else allocates or frees: not another test's threads in the same
pytest-xdist worker, nor MLX work they left queued. Each check measures it as a difference from before the node
existed; the bound is the ledger's own target: at most 10 % + 16 MiB over.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import mlx.core as mx
import pytest

from provider.engine.prefill_plan import longest_read
from provider.jobs import Job
from provider.outputs import Done
from tests.helpers import collect, greedy, make_node, run, until
from tools.harness.isolated import run_isolated

MiB = 1 << 20
WORDS = "cache batch token prompt model stream window prefix memory budget node server request reply".split()


def _prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) + f" {i}"


def _active() -> int:
    gc.collect()
    return mx.get_active_memory()


def _within(active: int, ledger: int) -> bool:
    return active <= ledger * 1.10 + 16 * MiB


def _prefix_entries_held(fixtures: str) -> dict:
    """Eight prompts served, then idle: what MLX holds beside the node's books (weights, prefix entries)."""
    base = _active()
    node = make_node({"m": Path(fixtures) / "llama-kv-heavy"}, max_concurrent_jobs=8, prefix_cache_gb=1.0)

    async def main():
        ends = await asyncio.gather(*(collect(node, Job(f"j{i}", "m", greedy(32), prompt=_prompt(i, 300 + 13 * i)))
                                      for i in range(8)))
        assert all(isinstance(end, Done) for _, _, end, _ in ends)
        st = node.status()
        out = {"held": _active() - base, "weights": st.models[0].measured_weight_bytes,
               "prefix": st.memory.prefix_cache_bytes, "jobs_kv": st.memory.jobs_kv_bytes}
        await node.stop()
        return out

    return run(main())


def test_prefix_entries_hold_only_their_own_bytes(fixtures_dir):
    m = run_isolated(_prefix_entries_held, str(fixtures_dir))
    assert m["jobs_kv"] == 0 and m["prefix"] > 0
    # Idle: MLX holds the weights and the prefix entries, and no more (an entry that is a slice of its
    # batch's buffers keeps the whole buffer: here about 40 MiB more).
    assert _within(m["held"], m["weights"] + m["prefix"]), {k: v / MiB for k, v in m.items()}


def test_a_draft_model_reads_a_cached_prefix_a_chunk_per_step(fixtures_dir, monkeypatch):
    from provider.engine.proposers import DraftModelDrafter

    node = make_node({"l": fixtures_dir / "llama-tiny"}, speculation="on", prefill_step_size=64, prefix_cache_gb=1.0,
                     manager_kw={"drafters": {"l": fixtures_dir / "llama-tiny-draft"}, "prefill_step": 64})
    reads: list[int] = []
    real_read = DraftModelDrafter.read

    def read(self, row, tokens):  # a spy: how much the draft model reads in one engine step
        reads.append(len(tokens))
        return real_read(self, row, tokens)

    monkeypatch.setattr(DraftModelDrafter, "read", read)
    prompt = _prompt(1, 200)

    async def main():
        _, _, first, _ = await collect(node, Job("a", "l", greedy(4), prompt=prompt))
        reads.clear()
        _, _, again, _ = await collect(node, Job("b", "l", greedy(4), prompt=prompt + " again"))
        assert isinstance(first, Done) and isinstance(again, Done)
        assert again.usage.cached_prompt_tokens > 64 and again.telemetry.speculation.mode == "draft"
        # The cached prefix is read by the draft model too, but never more than a chunk (the one chunk rule's
        # longest) in one engine step.
        assert reads and max(reads) <= longest_read(64) and sum(reads) >= again.usage.cached_prompt_tokens, reads
        await node.stop()

    run(main())


def _padded_batch_books(fixtures: str) -> dict:
    """Fifteen short jobs and a long one on one model, MLX's memory sampled against the books all along."""
    base = _active()
    node = make_node({"m": Path(fixtures) / "llama-kv-heavy"}, max_concurrent_jobs=16, prefix_cache_gb=0)
    over: list = []
    peak_booked = 0

    async def sample(stop: asyncio.Event):
        nonlocal peak_booked
        while not stop.is_set():
            mem, held = node.status().memory, _active() - base
            peak_booked = max(peak_booked, mem.jobs_kv_bytes)
            if not _within(held, mem.reserved_bytes):
                over.append((held / MiB, mem.reserved_bytes / MiB))
            await asyncio.sleep(0.02)

    async def main():
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        short = [collect(node, Job(f"s{i}", "m", greedy(48), prompt=_prompt(i, 6))) for i in range(15)]
        long = collect(node, Job("long", "m", greedy(8), prompt=_prompt(99, 700)))
        ends = await asyncio.gather(long, *short)
        stop.set()
        await sampler
        assert all(isinstance(end, Done) for _, _, end, _ in ends)
        out = {"peak_booked": peak_booked, "over": over, "long_tokens": ends[0][2].usage.prompt_tokens + 8,
               "jobs_kv_after": node.status().memory.jobs_kv_bytes}
        await node.stop()
        return out

    return run(main())


def test_a_long_prompt_beside_short_jobs_is_booked_as_the_padded_batch_it_makes(fixtures_dir):
    m = run_isolated(_padded_batch_books, str(fixtures_dir))
    per_token = 8 * 1024  # llama-kv-heavy: 4 layers x K,V x 8 heads x 32, float32
    # Every row is padded to the long one: the batch is booked as 16 of it, not as 1 long + 15 short.
    assert m["peak_booked"] >= 16 * m["long_tokens"] * per_token, (m["peak_booked"] / MiB, m["long_tokens"])
    assert not m["over"], m["over"]
    assert m["jobs_kv_after"] == 0


def test_drafter_headroom_counts_what_running_jobs_hold(fixtures_dir):
    from provider.memory.checkpoint import read_config
    from provider.drafters.assistant import KIND as ASSISTANT
    from provider.models.footprint import estimate_footprint

    kw = {"kv_reserve_tokens": 256, "prefill_step": 64}
    g, a = fixtures_dir / "gemma4-tiny", fixtures_dir / "gemma4-tiny-assistant"
    target = estimate_footprint(g, read_config(g), kv_tokens=256, prefill_step=64)
    need = ASSISTANT.footprint(a, read_config(a), 3, 64)
    busy = 4 * need  # what another model's running jobs hold
    slack = (need - target.kv) // 2  # beside the target and its one-sequence reserve, less than the drafter
    assert slack > 0
    node = make_node({"gemma": g, "other": fixtures_dir / "qwen3-tiny"}, budget_bytes=target.total + busy + slack,
                     manager_kw={"drafters": {"gemma": a}, **kw})

    async def main():
        node.models.book("other", busy)  # stands in for the other model's batches mid-run (their booking)
        done = (await collect(node, Job("g", "gemma", greedy(4), prompt="x")))[2]
        assert isinstance(done, Done)
        # Beside the target the budget has room for the drafter, but not beside the running jobs.
        assert done.telemetry.speculation.reason == "insufficient_headroom"
        await node.stop()

    run(main())


# --- images: their pixels and the vision tower's scratch in the books (issue 37, findings 3 and 4) -----------

def _png(w: int, h: int, seed: int = 0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _image_job(job_id: str, images: int, size: tuple[int, int] = (1, 1), detail: str = "high") -> Job:
    from provider.content import IMAGE_PART, ImageInput

    content = [dict(IMAGE_PART) for _ in range(images)] + [{"type": "text", "text": "What are they?"}]
    return Job(id=job_id, model="vlm", sampling=greedy(4), messages=({"role": "user", "content": content},),
               images=tuple(ImageInput(_png(*size, seed=i), detail) for i in range(images)))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    from tools.fixtures.vision import make_gemma4_vlm

    root = tmp_path_factory.mktemp("vlm")
    make_gemma4_vlm(root / "gemma4-vlm")
    return root / "gemma4-vlm"


def test_an_image_is_encoded_under_a_booking_that_holds_its_pixels_and_the_towers_scratch(vlm, monkeypatch):
    """Two high-detail image jobs admitted together: whenever the tower encodes, the model's booking holds the
    scratch of that encode and the pixels it reads (finding 4: the scratch was booked for an instant, at
    admission, and a second job in the same pass was admitted without it)."""
    import json

    from provider.memory.estimate import vision_scratch_bytes
    from provider.models.vision import VisionTower

    config = json.loads((vlm / "config.json").read_text())
    vc = config["vision_config"]
    node = make_node({"vlm": vlm}, max_concurrent_jobs=4, speculation="off")
    seen: list[dict] = []
    real_encode = VisionTower.encode

    def encode(self, pixels):  # a spy: the ledger at the moment the tower reads an image
        soft = pixels.shape[1] * pixels.shape[2] // vc["patch_size"] ** 2 // vc["pooling_kernel_size"] ** 2
        seen.append({"booked": node.models.memory_status(0).jobs_kv_bytes, "pixels": pixels.nbytes,
                     "scratch": vision_scratch_bytes(config, soft)})
        return real_encode(self, pixels)

    monkeypatch.setattr(VisionTower, "encode", encode)

    async def main():
        ends = await asyncio.gather(*(collect(node, _image_job(f"img{i}", 2)) for i in range(2)))
        assert all(isinstance(end, Done) for _, _, end, _ in ends), ends
        assert node.status().memory.jobs_kv_bytes == 0
        await node.stop()

    run(main())
    assert len(seen) == 4
    for s in seen:
        assert s["booked"] >= s["scratch"] + s["pixels"], {k: v / MiB for k, v in s.items()}


def _all_prepared(node, n: int) -> bool:
    try:  # the engine thread's queue, read from here: it may change under the read until all n are in
        line = node.engine._waiting.all()
        return len(line) == n and all(p.prepared.done() for p in line)
    except RuntimeError:
        return False


def _queued_image_jobs_held(root: str) -> dict:
    """Eight jobs of four high-detail images each, queued behind a running job: the bytes Python holds for them
    (tracemalloc traces numpy's buffers) once every one is prepared."""
    import tracemalloc

    from provider.engine.plain_batch import PlainBatch
    from provider.media.plan import media_bytes

    paused = {"vlm"}
    real_step = PlainBatch.step
    PlainBatch.step = lambda self: [] if self.lm.id in paused else real_step(self)
    node = make_node({"vlm": Path(root)}, max_concurrent_jobs=1, speculation="off")
    processor = node.prompts.tokenizer("vlm").images
    one_image = media_bytes(processor.prepare(_image_job("x", 1).images[0]))

    async def main():
        async with node.run(Job("text", "vlm", greedy(64), prompt="The cache")) as running:
            await running.__anext__()  # accepted: it holds the one slot, decoding nothing
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            streams = [node.run(_image_job(f"q{i}", 4)) for i in range(8)]
            for s in streams:
                await s.__aenter__()
            await until(lambda: _all_prepared(node, 8), "eight jobs queued and prepared")
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            for s in streams:
                await s.__aexit__(None, None, None)
        paused.clear()
        await node.stop()
        return {"held": held, "one_image": one_image, "prepared": 8 * 4 * one_image}

    return run(main())


def test_queued_image_jobs_hold_their_files_not_their_pixels(vlm):
    """Finding 3: a job's pixels are made when it is admitted, and booked from then; while it queues it holds its
    encoded files only. Eight queued jobs of four 1x1 PNGs at detail high held 8 x 4 x 6.75 MiB of float32
    before; now less than one image's."""
    m = run_isolated(_queued_image_jobs_held, str(vlm))
    assert m["held"] < m["one_image"], {k: v / MiB for k, v in m.items()}


# A hybrid Qwen3.5 whose Gated DeltaNet state dominates: 6 of 8 layers recurrent, each 16 value heads x 128 x 128
# in float32 (1 MiB a row), and 2 full-attention layers of 2 KiB of K/V a token: a row is ~6 MiB at any length.
HYBRID = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, full_attention_interval=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=16,
              linear_num_key_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    from tools.fixtures.mtp import make_qwen3_5_mtp_tiny

    out = tmp_path_factory.mktemp("hybrid") / "qwen3_5-stateful"
    make_qwen3_5_mtp_tiny(out, train=False, **HYBRID)
    return out


def test_a_hybrid_row_is_booked_as_the_caches_mlx_lm_makes_for_it(hybrid):
    """Its K/V per token for the full-attention layers only, and each recurrent layer's conv window and state
    once per row (the old estimate booked every layer's K/V per token and no state: 4x the K/V, and a 20-token
    row at 5 % of what it holds)."""
    from mlx_lm import load

    from provider.memory.checkpoint import read_config
    from provider.models.footprint import kv_shape_of

    model, _ = load(str(hybrid))
    caches = model.make_cache()
    mx.eval(model(mx.array([list(range(3, 23))]), cache=caches))
    kv = kv_shape_of(hybrid, read_config(hybrid))
    attention = [c for c in caches if hasattr(c, "keys")]
    capacity = attention[0].keys.shape[2]  # mlx-lm's KVCache holds whole steps of 256 positions
    assert kv.bytes_per_token_full * capacity == sum(c.nbytes for c in attention)
    assert kv.bytes_per_row == sum(c.nbytes for c in caches if not hasattr(c, "keys")) > 0
    assert kv.bytes_for(capacity) == sum(c.nbytes for c in caches)


def _hybrid_books(model: str) -> dict:
    """Eight hybrid jobs at once, each ending at its own step (a row's prefix entry is taken as it leaves), MLX
    sampled against the books all along, then idle: what MLX holds beside the weights and the prefix entries."""
    base = _active()
    node = make_node({"h": Path(model)}, max_concurrent_jobs=8, prefix_cache_gb=1.0, speculation="off")
    over: list = []

    async def sample(stop: asyncio.Event):
        while not stop.is_set():
            mem, held = node.status().memory, _active() - base
            if not _within(held, mem.reserved_bytes):
                over.append((round(held / MiB, 1), round(mem.reserved_bytes / MiB, 1)))
            await asyncio.sleep(0.02)

    async def main():
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        ends = await asyncio.gather(*(collect(node, Job(f"h{i}", "h", greedy(2 + 3 * i), prompt=_prompt(i, 12)))
                                      for i in range(8)))
        stop.set()
        await sampler
        assert all(isinstance(end, Done) for _, _, end, _ in ends)
        st = node.status()
        out = {"held": _active() - base, "weights": st.models[0].measured_weight_bytes, "over": over,
               "prefix": st.memory.prefix_cache_bytes, "jobs_kv": st.memory.jobs_kv_bytes,
               "entries": _entries(node)}
        await node.stop()
        return out

    return run(main())


def _entries(node) -> list[int]:
    """The booked bytes of each of the hybrid model's prefix entries (mlx-lm's LRUPromptCache's entries)."""
    lru = node.engine.prefix_cache("h")._lru
    return [lru._trie.get(m, tokens).nbytes for order in lru._lru._lrus.values() for m, tokens in order]


def test_a_hybrid_batch_and_its_prefix_entries_hold_what_the_books_say(hybrid):
    m = run_isolated(_hybrid_books, str(hybrid))
    assert m["jobs_kv"] == 0 and len(m["entries"]) >= 8
    # Each entry holds its row's recurrent state (6 layers of a float32 state and a 3-position conv window of
    # q, k and v) and its tokens' K/V: ~6 MiB whatever its length.
    state = 6 * 4 * (16 * 128 * 128 + 3 * (2 * 4 * 128 + 16 * 128))
    assert all(state <= e < state + 300 * 2 * 2048 for e in m["entries"]), (state, m["entries"])
    # Busy, every sample within the ledger's target; idle, MLX holds the weights and the entries, and no more
    # (an entry whose state is a row of its batch's arrays keeps the whole batch's: here ~4x the entries).
    assert not m["over"], m["over"]
    assert _within(m["held"], m["weights"] + m["prefix"]), {k: v / MiB for k, v in m.items() if isinstance(v, int)}


def _hybrid_read_peaks(model: str, reads=((1, 100), (2, 50))) -> list[tuple[int, int, int, int]]:
    """(rows, tokens, MLX's peak over one forward reading `tokens` of each row after a first chunk, what the node
    books for that read: its footprint's act_shape)."""
    from mlx_lm import load

    from provider.memory.checkpoint import read_config
    from provider.models.footprint import estimate_footprint

    lm, _ = load(model)
    act = estimate_footprint(Path(model), read_config(Path(model)), kv_tokens=256, prefill_step=160).act_shape
    out = []
    for rows, tokens in reads:
        cache = lm.make_cache()
        mx.eval(lm(mx.full((rows, 16), 5), cache=cache), [c.state for c in cache])
        x = mx.random.randint(3, 300, (rows, tokens))
        mx.eval(x)
        base = _active()
        mx.reset_peak_memory()
        mx.eval(lm(x, cache=cache), [c.state for c in cache])
        out.append((rows, tokens, mx.get_peak_memory() - base, act.prefill_bytes(rows, tokens, 16 + tokens)))
        del cache
    return out


def test_a_hybrid_prompt_read_holds_what_its_booking_says(hybrid):
    """On a CPU mlx-lm steps the Gated DeltaNet a position at a time and a chunk's read holds a layer's state per
    token read (here 1 MiB: ~1.1 GiB for 1,000 tokens), which the books once left out (0.6 MiB booked for a read
    holding 119)."""
    from provider.memory.estimate import stepped_recurrence

    if not stepped_recurrence(128):
        pytest.skip("MLX runs the Gated DeltaNet kernel here: nothing stepped")
    for rows, tokens, peak, booked in run_isolated(_hybrid_read_peaks, str(hybrid)):
        assert peak <= booked <= peak * 1.25 + 4 * MiB, (rows, tokens, peak / MiB, booked / MiB)


def test_a_mamba2_prompt_read_holds_what_its_booking_says(head_fixture):
    """mlx-lm reads a Nemotron-H prompt with its chunked SSD scan on every backend, whose [heads, block, block]
    matrices grow with the square of the tokens read (this fixture: 2.9 MiB for 100 tokens, 9.3 for 200), which
    the books once left out (0.65 and 1.9 MiB booked)."""
    target = head_fixture("nemotron_h-mtp-tiny")
    for rows, tokens, peak, booked in run_isolated(_hybrid_read_peaks, str(target), ((1, 100), (1, 200), (2, 50))):
        assert peak <= booked <= peak * 1.5 + 4 * MiB, (rows, tokens, peak / MiB, booked / MiB)


def _mla_held(config: dict, prompt: int = 40, decoded: int = 8) -> tuple[int, int, int]:
    """A tiny MLA target of `config`'s family (mlx-lm's own model, random float32 weights) reads a prompt and decodes
    some tokens: (positions, bytes its caches hold at those positions, bytes of their buffers)."""
    import importlib

    from mlx_lm.models.cache import CacheList, make_prompt_cache

    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    caches = make_prompt_cache(model)
    tokens = mx.array([[(7 * i) % 300 + 1 for i in range(prompt)]])
    for _ in range(decoded + 1):
        logits = model(tokens, cache=caches)
        tokens = mx.argmax(logits[:, -1:], axis=-1)
    subs = [s for c in caches for s in (c.caches if isinstance(c, CacheList) else (c,))]
    held = sum(a[..., : s.offset, :].nbytes for s in subs for a in (s.keys, s.values))
    return subs[0].offset, held, sum(s.nbytes for s in subs)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "deepseek_v3", "mistral4", "glm_moe_dsa", "deepseek_v32"])
def test_an_mla_targets_kv_is_booked_as_its_caches_hold_it(family):
    from provider.memory.estimate import KVQuant, full_layer_quant, kv_shape
    from tools.fixtures.mtp_glm import glm_config
    from tools.fixtures.mtp_glm5 import glm5_config

    ids = {"<|im_end|>": 2}
    config = (glm5_config(ids) if family in ("glm_moe_dsa", "deepseek_v32") else glm_config(ids)) | {
        "model_type": family}
    if family == "mistral4":  # its attention scales queries by Llama 4's rule, from these
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 2048}
    positions, held, buffers = _mla_held(config)
    assert positions == 48
    books = kv_shape(config, dtype_bytes=4)
    # The latent and the positional key (and a DSA layer's indexer keys and zeros) at every position, no more: the
    # books are what the caches hold, not per-head K and V (2 x 4 heads x 16 here, 3.6x the latent's 40 floats).
    assert books.bytes_for(positions) == held, (books, held)
    assert buffers <= books.bytes_for(256)  # the buffers grow 256 positions at a time (batch_kv's padding)
    # mlx-lm's latent attention cannot read a quantized cache: a node's kv_bits leaves it (and its books) as it is
    # (kv_quant.make_caches quantizes by full_layer_quant); head_dim 32 so that a group would fit if it were asked.
    quantizable = config | {"head_dim": 32}
    assert full_layer_quant(quantizable, KVQuant(4, 32)) is None
    assert kv_shape(quantizable, dtype_bytes=4, quant=KVQuant(4, 32)) == books


DEEPSEEK_V2 = {"model_type": "deepseek_v2", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
               "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
               "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 32,
               "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 48, "v_head_dim": 32,
               "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
               "rope_theta": 1e4, "topk_method": "greedy", "rope_scaling": {"type": "yarn", "factor": 1.0,
               "original_max_position_embeddings": 2048, "mscale_all_dim": 0}}


@pytest.mark.parametrize("bits", [0, 4])
def test_a_per_head_mla_targets_kv_is_booked_as_its_caches_hold_it(bits):
    """DeepSeek-V2 caches the latent expanded: per head a key of nope + rope (64) and a value of v_head_dim (32),
    which the per-head K and V of hidden / heads (16) under-books 3x; quantized (kv_quant.make_caches, as the
    engine makes them) in a group that divides both."""
    from mlx_lm.models import deepseek_v2

    from provider.engine.kv_quant import make_caches
    from provider.memory.estimate import KVQuant, kv_shape

    quant = KVQuant(bits, 64) if bits else None
    model = deepseek_v2.Model(deepseek_v2.ModelArgs.from_dict(DEEPSEEK_V2))
    mx.eval(model.parameters())
    caches = make_caches(model, DEEPSEEK_V2, quant)
    tokens = mx.array([[(7 * i) % 300 + 1 for i in range(40)]])
    for _ in range(9):
        tokens = mx.argmax(model(tokens, cache=caches)[:, -1:], axis=-1)
    n = caches[0].offset
    arrays = [x for c in caches for a in (c.keys, c.values) for x in (a if isinstance(a, tuple) else (a,))]
    assert n == 48 and kv_shape(DEEPSEEK_V2, 4, quant).bytes_for(n) == sum(x[..., :n, :].nbytes for x in arrays)
