"""The prefix cache's disk tier on real caches of real fixture models: a file holds exactly an entry's state,
anything but a whole, authentic file of the right scope and model is refused, and the tier keeps its byte
budget and write rate across restarts. (Files planted or rewritten, the directory and the key:
test_prefix_disk_trust.py.)"""

import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from provider.engine import kv_file
from provider.engine.prefix_blocks import BLOCK, chain, entry_key, scope_of
from provider.engine.prefix_disk import DiskTier

SCOPE, OTHER = scope_of("model-hash", "tenant-a"), scope_of("model-hash", "tenant-b")
KEY = bytes(range(32))


def layout(model):
    return kv_file.of_caches(prefill(model, [0]))


@pytest.fixture(scope="module")
def llama(fixtures_dir):
    from mlx_lm import load

    return load(str(fixtures_dir / "llama-tiny"))[0]


@pytest.fixture(scope="module")
def gemma(fixtures_dir):
    from mlx_lm import load

    return load(str(fixtures_dir / "gemma4-tiny"))[0]


def prefill(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache


def next_logits(model, cache, token):
    out = model(mx.array([[token]]), cache=cache)
    mx.eval(out)
    return out


def prompt(n, seed=0):
    return [(i * 7 + seed) % 200 + 3 for i in range(n)]


def until(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_an_entry_read_back_continues_as_the_original(which, request):
    model = request.getfixturevalue(which)
    tokens = prompt(300)
    cache = prefill(model, tokens)
    data = kv_file.encode(SCOPE, tokens, cache, KEY)
    read_tokens, restored = kv_file.decode(data, SCOPE, KEY, layout(model))
    assert read_tokens == tokens and [type(c) for c in restored] == [type(c) for c in cache]
    assert mx.array_equal(next_logits(model, cache, 5), next_logits(model, restored, 5))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_every_float_width_reads_back_bit_for_bit(llama, dtype):
    tokens = prompt(40)
    cache = prefill(llama, tokens)
    for c in cache:
        c.keys, c.values = c.keys.astype(dtype), c.values.astype(dtype)
    _, restored = kv_file.decode(kv_file.encode(SCOPE, tokens, cache, KEY), SCOPE, KEY,
                                 kv_file.of_caches(cache))
    for a, b in zip(cache, restored):
        assert b.keys.dtype == dtype and mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :])


def test_anything_but_a_whole_file_of_its_scope_is_refused(llama):
    tokens = prompt(BLOCK + 10)
    data = kv_file.encode(SCOPE, tokens, prefill(llama, tokens), KEY)
    with pytest.raises(kv_file.FileError, match="another scope"):
        kv_file.decode(data, OTHER, KEY, layout(llama))
    with pytest.raises(kv_file.FileError, match="MAC"):
        kv_file.decode(data, SCOPE, bytes(32), layout(llama))  # another node's key
    for bad in (data[:-1], data[: len(data) // 2], b"", data[:100] + bytes([data[100] ^ 1]) + data[101:],
                b"PXKV2\n" + b"\xff" * 64):
        with pytest.raises(kv_file.FileError):
            kv_file.decode(bad, SCOPE, KEY, layout(llama))


def test_block_hashes_find_shared_prefixes_and_only_in_their_scope():
    a, b = prompt(3 * BLOCK), prompt(2 * BLOCK) + prompt(BLOCK, seed=1)
    assert chain(SCOPE, a)[:2] == chain(SCOPE, b)[:2] and chain(SCOPE, a)[2] != chain(SCOPE, b)[2]
    assert chain(SCOPE, a)[0] != chain(OTHER, a)[0]
    assert len(chain(SCOPE, prompt(BLOCK - 1))) == 0 and entry_key(SCOPE, a) != entry_key(OTHER, a)


def test_the_tier_survives_a_restart_and_refuses_broken_files(llama, tmp_path):
    tokens = prompt(2 * BLOCK + 5)
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=1 << 30)
    assert disk.put(SCOPE, tokens, prefill(llama, tokens))
    until(lambda: disk.has(SCOPE, tokens))
    disk.close()
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=1 << 30)  # a restart
    assert disk.scanned.wait(30)
    longer = tokens + [9, 9, 9]
    key, usable = disk.best(SCOPE, longer, trimmable=True)
    assert usable == len(tokens)  # the whole entry: a prefix of the prompt
    assert disk.best(OTHER, longer, trimmable=True) is None  # never across scopes
    assert disk.best(SCOPE, prompt(BLOCK) + prompt(BLOCK + 5, seed=3), trimmable=True)[1] == BLOCK
    assert disk.best(SCOPE, prompt(BLOCK) + prompt(BLOCK + 5, seed=3), trimmable=False) is None
    read_tokens, cache = disk.read(key, SCOPE, layout(llama))
    assert read_tokens == tokens and cache[0].offset == len(tokens)
    path = next(tmp_path.glob("*.pxkv"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # truncated under a running node
    assert disk.read(key, SCOPE, layout(llama)) is None and disk.stats.corrupt == 1 and not path.exists()
    disk.close()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # corrupted while the node was down
    (tmp_path / "stray.tmp").write_bytes(b"half a write")
    (tmp_path / ("0" * 64 + ".pxkv")).write_bytes(b"PXKV2\n\xff\xff\xff\xff")  # a header past any bound
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=1 << 30)
    assert disk.scanned.wait(30)
    files = [p.name for p in tmp_path.iterdir() if not p.name.startswith("xdg_")]  # beside the state dir (its key)
    assert files == [path.name]  # the stray and the broken header: gone at start
    key, _ = disk.best(SCOPE, longer, trimmable=True)  # its header reads; its payload is checked when read
    assert disk.read(key, SCOPE, layout(llama)) is None and not path.exists() \
        and disk.best(SCOPE, longer, trimmable=True) is None
    disk.close()


def test_the_byte_budget_and_the_write_rate_hold(llama, tmp_path):
    caches = {i: (prompt(BLOCK + 1, seed=i), None) for i in range(12)}
    size = len(kv_file.encode(SCOPE, caches[0][0], prefill(llama, caches[0][0]), KEY))
    disk = DiskTier(tmp_path, max_bytes=3 * size, write_bytes_per_hour=1 << 40)
    for i, (tokens, _) in caches.items():
        disk.put(SCOPE, tokens, prefill(llama, tokens))
        until(lambda t=tokens: disk.has(SCOPE, t) or disk.stats.skipped_queue)
        assert disk.bytes_on_disk <= 3 * size
    assert sum(p.stat().st_size for p in tmp_path.glob("*.pxkv")) <= 3 * size and disk.stats.evicted >= 9
    disk.close()
    slow = DiskTier(tmp_path / "slow", max_bytes=1 << 30, write_bytes_per_hour=8 * size)  # a quarter-hour burst: 2
    written = sum(slow.put(SCOPE, t, prefill(llama, t)) for t, _ in caches.values())
    assert written == 2 and slow.stats.skipped_rate == len(caches) - 2
    slow.close()


def test_an_entry_read_ahead_is_made_from_memory(llama, tmp_path):
    tokens = prompt(2 * BLOCK + 5)
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=1 << 30)
    disk.put(SCOPE, tokens, prefill(llama, tokens))
    until(lambda: disk.has(SCOPE, tokens))
    longer = tokens + [7]
    disk.prefetch(SCOPE, longer, trimmable=True)  # as a prepared prompt asks, off the engine thread
    until(lambda: disk._prefetched)
    key, _ = disk.best(SCOPE, longer, trimmable=True)
    next(tmp_path.glob("*.pxkv")).unlink()  # gone from disk: what was read ahead serves
    read_tokens, cache = disk.read(key, SCOPE, layout(llama))
    assert read_tokens == tokens and not disk._prefetched
    disk.close()
