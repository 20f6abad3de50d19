"""A flood of distinct long prompts against the prefix cache's disk tier: its byte budget and write rate hold,
and files corrupted or cut short on disk are found and deleted, never loaded.

Entries are real caches (mlx-lm KVCache, small heads so the flood is quick) of distinct 300-token prompts, put
as fast as the engine would hand them over; a fraction of the files written is then corrupted or truncated and
every entry read back.

    python tools/scripts/prefix_disk_flood.py [--prompts 10000] [--budget-mib 64] [--rate-mib-per-hour 512]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.engine.prefix_blocks import entry_key, scope_of  # noqa: E402
from provider.engine.kv_file import of_caches  # noqa: E402
from provider.engine.prefix_disk import DiskTier  # noqa: E402

MiB = 1 << 20


def size_of(root: Path) -> int:
    """Bytes of the tier's files now (one evicted while they are listed counts nothing)."""
    total = 0
    for p in root.glob("*.pxkv"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def cache_of(n: int, seed: int) -> list[KVCache]:
    c = KVCache()
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed)).astype(mx.float16)
    c.update_and_fetch(k, k)
    mx.eval(c.keys)
    return [c, c]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--rate-mib-per-hour", type=int, default=512)
    args = ap.parse_args()
    scope, rng = scope_of("flood", "tenant"), random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        disk = DiskTier(root, args.budget_mib * MiB, args.rate_mib_per_hour * MiB)
        t0, peak, queued = time.monotonic(), 0, []
        for i in range(args.prompts):
            tokens = [rng.randrange(2**16) for _ in range(300)]
            if disk.put(scope, tokens, cache_of(300, i)):
                queued.append(tokens)
            if i % 100 == 0:
                peak = max(peak, size_of(root))
        disk.close()
        seconds = time.monotonic() - t0
        on_disk = size_of(root)
        st = disk.status()
        print(f"{args.prompts} distinct prompts in {seconds:.1f} s: {st.writes} written ({st.bytes_written / MiB:.1f} "
              f"MiB), {st.skipped_writes} skipped over the write rate ({args.rate_mib_per_hour} MiB/h: a quarter "
              f"hour's burst, then the rate)")
        print(f"on disk: {on_disk / MiB:.1f} MiB at the end, {peak / MiB:.1f} MiB at the most sampled "
              f"(budget {args.budget_mib} MiB): {'within' if max(on_disk, peak) <= args.budget_mib * MiB else 'OVER'}")
        allowed = args.rate_mib_per_hour * MiB * (0.25 + seconds / 3600)  # the burst, and the rate since
        print(f"written {st.bytes_written / MiB:.1f} MiB of the {allowed / MiB:.1f} MiB the rate allows over the run")
        ok = max(on_disk, peak) <= args.budget_mib * MiB and st.bytes_written <= allowed
        files = sorted(root.glob("*.pxkv"))
        broken = files[: len(files) // 3]
        for j, path in enumerate(broken):
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if j % 2 else data[:-5] + b"\0\0\0\0\0")
        disk = DiskTier(root, args.budget_mib * MiB, args.rate_mib_per_hour * MiB)
        disk.scanned.wait()
        loaded = refused = 0
        keys = {entry_key(scope, t): t for t in queued}
        for path in files:
            got = disk.read(path.stem, scope, of_caches(cache_of(1, 0))) if path.stem in keys else None
            loaded += got is not None
            refused += got is None
        disk.close()
        print(f"{len(broken)} of {len(files)} files corrupted or truncated: {refused} refused and deleted, {loaded} "
              f"read back; any broken file loaded: {'no' if refused >= len(broken) and loaded == len(files) - len(broken) else 'YES'}")
        ok = ok and refused == len(broken) and loaded == len(files) - len(broken)
        print("verdict:", "ok" if ok else "FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
