"""The disk tier trusts nothing in its directory (issue 56), through the real node on fixture models: a file
planted or rewritten without the node's key is refused; one with the key that is not a cache of the model
(a layer short, a shape whose element count wraps, an offset past its keys) is refused; a header token out of
range, a FIFO, a symlink to /dev/zero or a file grown since it was indexed is removed and counted, never read
past its size, and never stops the writer; the directory is the node's (0700, this user's) and its key 0600;
the write rate is asked before an entry is copied. Each refused file is deleted and counted (`refused_files`),
and the job's tokens are those computed from scratch."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
import tracemalloc

import pytest

from provider import paths
from provider.engine import kv_file
from provider.engine.prefix_blocks import BLOCK, scope_of
from provider.engine.prefix_disk import DiskTier
from provider.jobs import Job
from provider.outputs import Done
from provider.models.default import DEMO_TARGET
from tests.helpers import LocalServer, collect, greedy, make_node, run
from tests.test_prefix_disk import llama, prefill, prompt  # noqa: F401 (llama: a fixture)
from tests.test_prefix_disk_node import PROMPT, node_on

MODEL = "llama-tiny"
KEY_FILE = "prefix-disk.key"


# --- files as someone who can write the directory makes them ------------------------------------------------

def split(data: bytes) -> tuple[dict, bytes]:
    """A file's header and payload (the header's MAC, when the format has one, left out)."""
    (n,) = struct.unpack_from("<I", data, 6)
    header = json.loads(data[10:10 + n])
    return header, data[10 + n + (32 if data.startswith(b"PXKV2") else 0):-32]


def unkeyed(data: bytes, header: dict, payload: bytes) -> bytes:
    """`data` with this header and payload, and a SHA-256 where its MAC was: all anyone without the key can do."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    body = data[:6] + struct.pack("<I", len(raw)) + raw + payload
    return body + hashlib.sha256(body).digest()


def keyed(data: bytes, header: dict, payload: bytes) -> bytes:
    """The same, authenticated with the node's own key (a bug of its own, or a file of another version of it)."""
    key_file = paths.state_dir() / KEY_FILE
    if not key_file.exists():  # before issue 56 there was no key: the digest was the whole check
        return unkeyed(data, header, payload)
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join(kv_file.seal(kv_file.MAGIC + struct.pack("<I", len(raw)) + raw, [payload],
                                 key_file.read_bytes()))


def one_layer(header: dict, payload: bytes) -> tuple[dict, bytes]:
    first = header["layers"][0]
    end = sum(a["nbytes"] for a in first["arrays"])
    return header | {"layers": [first]}, payload[:end]


def zeroed(header: dict, payload: bytes) -> tuple[dict, bytes]:
    return header, bytes(len(payload))


def wrapped_shape(header: dict, payload: bytes) -> tuple[dict, bytes]:
    """Layer 0's keys as 2^64 elements: 0 in int64, so 0 bytes agree with the shape's count."""
    keys = header["layers"][0]["arrays"][0]
    keys |= {"shape": [1 << 16] * 4, "nbytes": 0}
    return header, payload


def offset_past_keys(header: dict, payload: bytes) -> tuple[dict, bytes]:
    header["layers"][0]["ints"][0] += 1000
    return header, payload


# --- the node ---------------------------------------------------------------------------------------------

async def once(fixtures_dir, disk_dir, job_id):
    """One job of PROMPT on a node of its own (as after a restart): its ids, its telemetry, its disk tier."""
    node = node_on(fixtures_dir, MODEL, disk_dir)
    try:
        ids, _, end, _ = await collect(node, Job(job_id, MODEL, greedy(8), prompt_ids=tuple(PROMPT)))
    finally:
        await node.stop()
    assert isinstance(end, Done)
    return ids, end.telemetry, node.prefix_disk.status()


def entry_file(disk_dir):
    files = list(disk_dir.glob("*.pxkv"))
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("bits, kinds, precision", [(8, {"quantized_row", "rotating"}, "float16"),
                                                     (4, {"quantized_row", "quantized_rotating"}, "float32")])
def test_every_cache_kind_the_node_writes_passes_the_models_checks(tmp_path, demo_f32, bits, kinds, precision):
    """Quantized rows, sliding windows in full precision and quantized (the demo model at kv_bits 8, as shipped in
    float16: 16-bit scales and windows through the files' float16 path; at 4 in float32, conftest's demo_f32; past
    its 128-token window): the node's own entries agree with the layout it takes from the model, and read back
    the same."""
    name, model = "demo", DEMO_TARGET if precision == "float16" else demo_f32[0]

    async def once_quantized(job_id):
        node = make_node({name: model}, manager_kw={"kv_bits": bits}, max_concurrent_jobs=2,
                         prefix_disk_dir=str(tmp_path), prefix_disk_gb=1.0)
        assert node.prefix_disk.scanned.wait(30)
        try:
            ids, _, end, _ = await collect(node, Job(job_id, name, greedy(8), prompt_ids=tuple(PROMPT)))
        finally:
            await node.stop()
        return ids, end.telemetry, node.prefix_disk.status()

    async def main():
        cold_ids, cold, _ = await once_quantized("cold")
        files = list(tmp_path.glob("*.pxkv"))
        assert files and {layer["kind"] for p in files for layer in split(p.read_bytes())[0]["layers"]} == kinds
        warm_ids, warm, disk = await once_quantized("warm")
        assert cold.prefix_tier == "" and warm.prefix_tier == "disk" and warm.cached_prompt_tokens >= 512
        assert warm_ids == cold_ids and disk.refused_files == 0

    run(main())


@pytest.mark.parametrize("forge, edit", [(unkeyed, zeroed), (unkeyed, one_layer), (keyed, one_layer),
                                         (keyed, wrapped_shape), (keyed, offset_past_keys)],
                         ids=["zeroed-kv", "one-layer", "one-layer-keyed", "wrapped-shape-keyed",
                              "offset-past-keys-keyed"])
def test_a_planted_or_rewritten_file_is_refused_deleted_and_counted_and_the_tokens_stay(fixtures_dir, tmp_path,
                                                                                        forge, edit):
    async def main():
        cold_ids, cold, _ = await once(fixtures_dir, tmp_path, "cold")
        assert cold.prefix_tier == ""
        path = entry_file(tmp_path)
        data = path.read_bytes()
        path.write_bytes(forge(data, *edit(*split(data))))
        ids, warm, disk = await once(fixtures_dir, tmp_path, "warm")
        assert ids == cold_ids
        assert warm.prefix_tier == "" and warm.cached_prompt_tokens == 0  # computed, not read
        assert disk.refused_files == 1 and disk.hits == 0
        assert [p.name for p in tmp_path.glob("*.pxkv")] == [path.name]  # written again, by the node
        assert path.read_bytes() != forge(data, *edit(*split(data)))
        again_ids, again, _ = await once(fixtures_dir, tmp_path, "again")
        assert again.prefix_tier == "disk" and again_ids == cold_ids  # the node's own file serves

    run(main())


def test_a_header_token_out_of_range_never_stops_the_writer(fixtures_dir, tmp_path):
    async def main():
        await once(fixtures_dir, tmp_path, "cold")
        path = entry_file(tmp_path)
        data = path.read_bytes()
        header, payload = split(data)
        header["tokens"][0] = -1
        path.write_bytes(keyed(data, header, payload))  # even under the node's key
        _, warm, disk = await once(fixtures_dir, tmp_path, "warm")
        assert warm.prefix_tier == "" and disk.refused_files == 1
        assert disk.writes == 1  # the writer thread lived through it: the job's entry is on disk
        _, again, disk = await once(fixtures_dir, tmp_path, "again")  # and after a restart
        assert again.prefix_tier == "disk" and disk.refused_files == 0

    run(main())


def test_a_symlink_or_a_grown_file_is_never_read_past_its_indexed_size(fixtures_dir, tmp_path):
    """A name of the index made a symlink to /dev/zero (which a read with no bound would read until memory ran
    out), or a regular file grown since it was indexed: refused, deleted, counted; the job computes its KV."""
    async def main():
        cold_ids, _, _ = await once(fixtures_dir, tmp_path, "cold")
        path = entry_file(tmp_path)
        data = path.read_bytes()
        for swap in (lambda: (path.unlink(), path.symlink_to("/dev/zero")),
                     lambda: path.write_bytes(data + bytes(64 << 20))):
            node = node_on(fixtures_dir, MODEL, tmp_path)  # the file indexed as it is
            try:
                swap()
                ids, _, end, _ = await collect(node, Job("warm", MODEL, greedy(8), prompt_ids=tuple(PROMPT)))
            finally:
                await node.stop()
            assert end.telemetry.prefix_tier == "" and ids == cold_ids
            assert node.prefix_disk.status().refused_files == 1
            assert not path.is_symlink() and path.read_bytes() != data + bytes(64 << 20)  # the job's own entry
            path.write_bytes(data)

    run(main())


def test_a_file_grown_while_the_node_was_down_is_refused_at_the_scan_never_read(fixtures_dir, tmp_path):
    """An authentic entry given a sparse tail while the node was down (found by a review: its header still
    authenticates, so the scan indexed it at its new size and the first matching prompt read a gibibyte into
    memory, twice, before its MAC refused it): the scan compares the size with the arrays its header lists."""
    async def main():
        cold_ids, _, _ = await once(fixtures_dir, tmp_path, "cold")
        path = entry_file(tmp_path)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size + (1 << 30))
        node = node_on(fixtures_dir, MODEL, tmp_path)
        try:
            refused = node.prefix_disk.status().refused_files  # at the scan, before any prompt
            ids, _, end, _ = await collect(node, Job("warm", MODEL, greedy(8), prompt_ids=tuple(PROMPT)))
        finally:
            await node.stop()
        assert refused == 1 and end.telemetry.prefix_tier == "" and ids == cold_ids
        assert not path.exists() or path.stat().st_size < 1 << 30

    run(main())


def test_a_symlink_or_a_fifo_under_an_entrys_name_is_removed_at_start_never_opened(llama, tmp_path):  # noqa: F811
    (tmp_path / ("a" * 64 + ".pxkv")).symlink_to("/dev/zero")
    fifo = tmp_path / ("b" * 64 + ".pxkv")
    os.mkfifo(fifo)
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=1 << 30)
    try:
        assert disk.scanned.wait(10), "the scan hangs on the FIFO"
        assert not list(tmp_path.glob("*.pxkv")) and disk.stats.corrupt == 2
        tokens = prompt(2 * BLOCK + 5)
        assert disk.put(scope_of("m", "t"), tokens, prefill(llama, tokens))
        deadline = time.monotonic() + 30
        while not disk.has(scope_of("m", "t"), tokens):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let a reader blocked on it go
        except OSError:  # gone, or nobody reading it
            pass
        disk.close()


def test_the_write_rate_is_asked_before_an_entry_is_copied(llama, tmp_path):  # noqa: F811
    tokens = prompt(8 * BLOCK)
    cache = prefill(llama, tokens)
    size = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert size >= 2 << 20
    disk = DiskTier(tmp_path, max_bytes=1 << 30, write_bytes_per_hour=4)  # a burst of 1 byte
    tracemalloc.start()
    try:
        assert not disk.put(scope_of("m", "t"), tokens, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        disk.close()
    assert disk.stats.skipped_rate == 1
    # What it costs is the header (JSON of the token ids, ~90 bytes a token at its peak), not the KV: 1 KiB a
    # token on this tiny model, 100+ KiB on a real one.
    assert peak < size // 8, f"{peak} bytes held to refuse an entry of {size}"


# --- the directory and the key ------------------------------------------------------------------------------

def test_the_directory_is_made_private_and_one_of_another_user_is_refused(fixtures_dir, tmp_path):
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir(mode=0o777)
    disk_dir.chmod(0o777)
    node = make_node({MODEL: fixtures_dir / MODEL}, prefix_disk_dir=str(disk_dir), prefix_disk_gb=1.0)
    run(node.stop())
    assert stat.S_IMODE(disk_dir.stat().st_mode) == 0o700
    if os.geteuid() != 0:
        pytest.skip("giving the directory to another user needs root")
    os.chown(disk_dir, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        make_node({MODEL: fixtures_dir / MODEL}, prefix_disk_dir=str(disk_dir), prefix_disk_gb=1.0)


def test_the_key_is_private_in_the_state_dir_and_provider_start_refuses_one_others_can_read(fixtures_dir,
                                                                                          tmp_path):
    server = LocalServer(fixtures_dir / MODEL, tmp_path)
    key = tmp_path / "state" / "provider" / KEY_FILE
    try:
        assert key.exists() and stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    finally:
        server.stop()
    key.chmod(0o644)
    with pytest.raises(RuntimeError, match="chmod 600") as refused:
        server = LocalServer(fixtures_dir / MODEL, tmp_path)
        server.stop()  # it started: the test fails above
    assert "cannot start" in str(refused.value)
