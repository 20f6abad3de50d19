"""The prefix cache's disk tier: entries that survive a restart, an eviction from memory, a model unload.

An entry is one file (kv_file.py) named by its key (prefix_blocks.entry_key) in the model's directory under
the root; the index in memory holds, per entry, its scope, its block hashes, its length and the few tokens
after its last full block, so a lookup finds the entry sharing the most blocks with a prompt without opening a
file. Files are written by one writer thread, never the engine's: the engine hands over an entry's bytes
(copied out of MLX on its own thread) and goes on. Two bounds keep a disk from filling or wearing out:
`max_bytes` (least recently used entries deleted past it) and `write_bytes_per_hour` (a token bucket; a write
past it is skipped, not queued). A file that fails its digest is deleted and never loaded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import logs
from ..status import PrefixDiskStatus
from . import kv_file
from .prefix_blocks import BLOCK, chain, entry_key

log = logs.get("engine")
SUFFIX = ".pxkv"
QUEUE = 8  # entries waiting for the writer; past it a write is skipped (the memory tier still holds it)
PREFETCH_BYTES = 512 << 20  # files read ahead of the prefill that needs them, held at most (host memory)
MAX_CLAIMS = 4096  # finished jobs whose entries are followed (routing.HeldPrefixes asks); the oldest are given up


@dataclass
class DiskEntry:
    scope: bytes
    blocks: list[bytes]
    length: int
    tail: tuple[int, ...]  # tokens after the last full block
    size: int
    used: float  # last written or read (time.time())


@dataclass
class DiskStats:
    hits: int = 0
    tokens_reused: int = 0
    writes: int = 0
    bytes_written: int = 0
    skipped_rate: int = 0
    skipped_queue: int = 0
    corrupt: int = 0
    evicted: int = 0


class DiskTier:
    def __init__(self, root: Path, max_bytes: int, write_bytes_per_hour: int):
        self.root = root
        self.max_bytes = max_bytes
        self.rate = write_bytes_per_hour
        self.stats = DiskStats()
        self._started = time.monotonic()
        self._index: dict[str, DiskEntry] = {}
        self._claims: collections.OrderedDict[str, str] = collections.OrderedDict()  # job id -> the entry it left
        self._lock = threading.Lock()
        self._allowance, self._refilled = float(write_bytes_per_hour) / 4, time.monotonic()  # a quarter hour's burst
        self._queue: queue.Queue = queue.Queue(QUEUE)
        # Read ahead, off the engine thread: a prepared prompt's best entry, its digest checked (prefetch).
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-read")
        self._prefetched: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The files already there are indexed by the writer thread before it writes: never on a start's path
        # (a lookup meanwhile finds less, never anything wrong).
        self.scanned = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    @classmethod
    def configured(cls, directory: str, gb: float, write_gb_per_hour: float) -> "DiskTier":
        """The node's, from its settings: at most `gb`, and never past a tenth of the disk's free space now."""
        import shutil

        from .. import paths

        root = Path(directory).expanduser() if directory else paths.cache_dir() / "prefix-cache"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        budget = min(int(gb * (1 << 30)), shutil.disk_usage(root).free // 10)
        return cls(root, budget, int(write_gb_per_hour * (1 << 30)))

    def status(self) -> PrefixDiskStatus:
        s, hours = self.stats, max(time.monotonic() - self._started, 60.0) / 3600
        with self._lock:
            on_disk, entries = sum(e.size for e in self._index.values()), len(self._index)
        return PrefixDiskStatus(on_disk, self.max_bytes, entries, s.hits, s.tokens_reused, s.writes, s.bytes_written,
                                round(s.bytes_written / hours), self.rate, s.skipped_rate + s.skipped_queue, s.corrupt)

    @property
    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.values())

    # --- engine thread ----------------------------------------------------------------

    def has(self, scope: bytes, tokens: list[int]) -> bool:
        with self._lock:
            return entry_key(scope, tokens) in self._index

    def holds(self, claim: str) -> bool:
        """Any thread: whether the entry job `claim` left (`put`) is on disk now."""
        with self._lock:
            key = self._claims.get(claim)
            return key is not None and key in self._index

    def put(self, scope: bytes, tokens: list[int], cache: list, claim: str = "") -> bool:
        """Queue an entry for writing (its arrays copied out now); False if skipped (kind, rate, queue). The job
        `claim` finished is held while the entry is on disk."""
        if len(tokens) < BLOCK or not kv_file.storable(cache):
            return False
        if self.has(scope, tokens):
            self._claim(claim, entry_key(scope, tokens))
            return False
        try:
            data = kv_file.encode(scope, tokens, cache)
        except kv_file.FileError:
            return False
        if not self._spend(len(data)):
            self.stats.skipped_rate += 1
            return False
        blocks = chain(scope, tokens)
        key = entry_key(scope, tokens, blocks)
        try:
            self._queue.put_nowait((key, data, DiskEntry(
                scope, blocks, len(tokens), tuple(tokens[len(blocks) * BLOCK:]), len(data), time.time())))
        except queue.Full:
            self.stats.skipped_queue += 1
            return False
        self._claim(claim, key)
        return True

    def _claim(self, claim: str, key: str) -> None:
        if claim:
            with self._lock:
                self._claims[claim] = key
                while len(self._claims) > MAX_CLAIMS:
                    self._claims.popitem(last=False)

    def best(self, scope: bytes, prompt: list[int], trimmable: bool) -> tuple[str, int] | None:
        """The entry sharing the most tokens with `prompt` (block-exact; the file's tokens settle the rest), and
        how many: for an entry that cannot be trimmed, only one that is a whole prefix of the prompt."""
        blocks = chain(scope, prompt)
        with self._lock:
            found = None
            for key, e in self._index.items():
                if e.scope != scope or not blocks or e.blocks[0] != blocks[0]:
                    continue
                shared = _shared(e.blocks, blocks)
                whole = shared == len(e.blocks) and e.length < len(prompt) and \
                    tuple(prompt[shared * BLOCK:e.length]) == e.tail
                # A trimmable entry serves any shared prefix, one token short of the whole prompt at most.
                usable = e.length if whole else min(shared * BLOCK, len(prompt) - 1) if trimmable else 0
                if usable > (found[1] if found else 0):
                    found = (key, usable)
            return found

    def prefetch(self, scope: bytes, prompt: list[int], trimmable: bool) -> None:
        """Read the entry `best` would give `prompt` into host memory now, on the reader thread, so the engine
        thread's `read` only makes its arrays. Never blocks the caller; a prompt without one reads nothing."""
        def read_ahead() -> None:
            found = self.best(scope, prompt, trimmable)
            if found is None:
                return
            try:
                data = self._path(found[0]).read_bytes()
                kv_file.read_header(data)  # its digest, before it is held
            except (OSError, kv_file.FileError):
                return  # `read` finds it again, and deletes it if it is broken
            with self._lock:
                self._prefetched[found[0]] = data
                while sum(map(len, self._prefetched.values())) > PREFETCH_BYTES and len(self._prefetched) > 1:
                    self._prefetched.popitem(last=False)

        try:
            self._reader.submit(read_ahead)
        except RuntimeError:  # closed
            pass

    def read(self, key: str, scope: bytes) -> tuple[list[int], list] | None:
        """The entry's tokens and caches, or None (gone, or failed its check: then deleted)."""
        path = self._path(key)
        with self._lock:
            data = self._prefetched.pop(key, None)
        try:
            data = path.read_bytes() if data is None else data
            tokens, cache = kv_file.decode(data, scope)
        except OSError:
            self._forget(key)
            return None
        except kv_file.FileError as e:
            self.stats.corrupt += 1
            log.warning("prefix_disk_file_refused", file=path.name, why=str(e))
            self._delete(key)
            return None
        with self._lock:
            if key in self._index:
                self._index[key].used = time.time()
        self.stats.hits += 1
        return tokens, cache

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._queue.put(None)
        self._writer.join(timeout=30)

    # --- writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            self._scan()
        finally:
            self.scanned.set()
        while (item := self._queue.get()) is not None:
            key, data, entry = item
            tmp = self._path(key).with_suffix(".tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(key))
            except OSError as e:
                log.warning("prefix_disk_write_failed", error=str(e))
                tmp.unlink(missing_ok=True)
                continue
            with self._lock:
                self._index[key] = entry
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
            self._evict()

    def _evict(self) -> None:
        with self._lock:
            order = sorted(self._index, key=lambda k: self._index[k].used)
            total = sum(e.size for e in self._index.values())
            gone = []
            while total > self.max_bytes and order:
                key = order.pop(0)
                total -= self._index.pop(key).size
                gone.append(key)
        for key in gone:
            self._path(key).unlink(missing_ok=True)
            self.stats.evicted += 1

    # --- any thread -------------------------------------------------------------------

    def _spend(self, n: int) -> bool:
        with self._lock:
            now = time.monotonic()
            self._allowance = min(self.rate / 4, self._allowance + (now - self._refilled) * self.rate / 3600)
            self._refilled = now
            if n > self._allowance:
                return False
            self._allowance -= n
            return True

    def _scan(self) -> None:
        """The index from the files already there (a restart): headers checked, broken files deleted."""
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                header = kv_file.peek_header(path)
                scope, tokens = bytes.fromhex(header["scope"]), header["tokens"]
                blocks = chain(scope, tokens)
                if entry_key(scope, tokens, blocks) != path.stem:
                    raise kv_file.FileError("named for another entry")
                stat = path.stat()
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                self.stats.corrupt += 1
                log.warning("prefix_disk_file_refused", file=path.name, why=str(e))
                path.unlink(missing_ok=True)
                continue
            with self._lock:
                self._index.setdefault(path.stem, DiskEntry(scope, blocks, len(tokens),
                                                            tuple(tokens[len(blocks) * BLOCK:]), stat.st_size,
                                                            stat.st_mtime))
        for tmp in self.root.glob("*.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        self._evict()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _delete(self, key: str) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)


def _shared(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
