"""The prefix cache's disk tier: entries that survive a restart, an eviction from memory, a model unload.

An entry is one file (kv_file.py) named by its key (prefix_blocks.entry_key) in the model's directory under
the root; the index in memory holds, per entry, its scope, its block hashes, its length and the few tokens
after its last full block, so a lookup finds the entry sharing the most blocks with a prompt without opening a
file. Files are written by one writer thread, never the engine's: the engine hands over an entry's bytes
(copied out of MLX on its own thread) and goes on; the writer MACs and writes them. Two bounds keep a disk from
filling or wearing out: `max_bytes` (least recently used entries deleted past it) and `write_bytes_per_hour` (a
token bucket, charged from the entry's shapes before a byte is copied; a write past it is skipped, not queued).

The tier owns its directory and trusts no file in it (issue 56; prefix_disk_dir.py, kv_file.py): only regular
files, never through a symlink, each read no further than the size indexed, each used only once its MAC under
the node's key matches and its header agrees with the model's caches (kv_layout.py). A file that fails any of
it is deleted and counted (`corrupt`; a log line names the file's hash and the reason, never its tokens). One
file's failure never stops the writer thread: it is logged and the next item goes on.
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
from . import kv_file, prefix_disk_dir
from .kv_layout import Layout
from .prefix_disk_dir import NotAnEntry
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
    def __init__(self, root: Path, max_bytes: int, write_bytes_per_hour: int, key: bytes | None = None):
        self.root = prefix_disk_dir.own(root)  # 0700, this user's (DiskDirError otherwise)
        self.key = prefix_disk_dir.load_key() if key is None else key  # the state directory's (0600)
        self.max_bytes = max_bytes
        self.rate = write_bytes_per_hour
        self.stats = DiskStats()
        self._started = time.monotonic()
        self._index: dict[str, DiskEntry] = {}
        self._claims: collections.OrderedDict[str, str] = collections.OrderedDict()  # job id -> the entry it left
        self._lock = threading.Lock()
        self._allowance, self._refilled = float(write_bytes_per_hour) / 4, time.monotonic()  # a quarter hour's burst
        self._queue: queue.Queue = queue.Queue(QUEUE)
        # Read ahead, off the engine thread: a prepared prompt's best entry, within its indexed size (prefetch);
        # its MAC and layout are checked when it is used (read).
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-read")
        self._prefetched: collections.OrderedDict[str, bytes] = collections.OrderedDict()
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

        root = prefix_disk_dir.own(Path(directory).expanduser() if directory else paths.cache_dir() / "prefix-cache")
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
        `claim` finished is held while the entry is on disk. The rate and the queue are asked before anything is
        copied: a write they refuse costs the engine thread only the header."""
        if len(tokens) < BLOCK or not kv_file.storable(cache):
            return False
        if self.has(scope, tokens):
            self._claim(claim, entry_key(scope, tokens))
            return False
        if self._queue.full():
            self.stats.skipped_queue += 1
            return False
        try:
            planned = kv_file.plan(scope, tokens, cache)
        except kv_file.FileError:
            return False
        if not self._spend(planned.size):
            self.stats.skipped_rate += 1
            return False
        blocks = chain(scope, tokens)
        key = entry_key(scope, tokens, blocks)
        try:
            self._queue.put_nowait((key, planned.head, kv_file.copy_out(planned), DiskEntry(
                scope, blocks, len(tokens), tuple(tokens[len(blocks) * BLOCK:]), planned.size, time.time())))
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
                data = self._read(found[0])
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

    def read(self, key: str, scope: bytes, layout: Layout | None) -> tuple[list[int], list] | None:
        """The entry's tokens and caches, checked against `layout` (the model's), or None: gone, or unreadable or
        failing a check (then deleted and counted)."""
        with self._lock:
            data = self._prefetched.pop(key, None)
        try:
            data = self._read(key) if data is None else data
            tokens, cache = kv_file.decode(data, scope, self.key, layout)
        except FileNotFoundError:
            self._forget(key)
            return None
        except Exception as e:  # noqa: BLE001 - NotAnEntry, FileError, or anything else a file could cause
            self._refuse(self._path(key).name, e)
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
        except Exception:  # the directory itself unreadable: the tier starts empty, and still writes
            log.exception("prefix_disk_scan_failed")
        finally:
            self.scanned.set()
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except Exception:  # one entry's failure is that entry's: the thread goes on
                log.exception("prefix_disk_write_failed")

    def _write(self, key: str, head: bytes, chunks: list[bytes], entry: DiskEntry) -> None:
        tmp = self._path(key).with_suffix(".tmp")
        pieces = kv_file.seal(head, chunks, self.key)
        entry.size = sum(map(len, pieces))
        try:
            with os.fdopen(prefix_disk_dir.create_new(tmp), "wb") as f:
                f.writelines(pieces)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("prefix_disk_write_failed", error=e.strerror)
            prefix_disk_dir.remove(tmp)
            return
        with self._lock:
            self._index[key] = entry
        self.stats.writes += 1
        self.stats.bytes_written += entry.size
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
            prefix_disk_dir.remove(self._path(key))
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
        """The index from the files already there (a restart): regular files whose header is authentic and names
        them; anything else under an entry's name is deleted, one name at a time (none stops the scan)."""
        regular, other = prefix_disk_dir.names(self.root, SUFFIX)
        for name in other:  # a symlink, a FIFO, a device: never opened
            self._refuse(name, NotAnEntry("not a regular file"))
            prefix_disk_dir.remove(self.root / name)
        for name in regular:
            path = self.root / name
            try:
                entry = self._indexed(path)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - whatever a file holds, it is that file's end, not the scan's
                self._refuse(name, e)
                prefix_disk_dir.remove(path)
                continue
            with self._lock:
                self._index.setdefault(path.name[:-len(SUFFIX)], entry)
        for name in sum(prefix_disk_dir.names(self.root, ".tmp"), []):  # a write cut short by a crash
            prefix_disk_dir.remove(self.root / name)
        self._evict()

    def _indexed(self, path: Path) -> DiskEntry:
        with prefix_disk_dir.open_entry(path) as f:
            header = kv_file.read_head(f, self.key)
            st = os.fstat(f.fileno())
            if st.st_size != kv_file.whole_size(f, header):  # grown (a sparse tail) or cut: its read is never made
                raise kv_file.FileError(f"{st.st_size} bytes, not the {kv_file.whole_size(f, header)} its header lists")
        scope, tokens = bytes.fromhex(header["scope"]), header["tokens"]
        blocks = chain(scope, tokens)
        if entry_key(scope, tokens, blocks) != path.name[:-len(SUFFIX)]:
            raise kv_file.FileError("named for another entry")
        return DiskEntry(scope, blocks, len(tokens), tuple(tokens[len(blocks) * BLOCK:]), st.st_size, st.st_mtime)

    def _read(self, key: str) -> bytes:
        """The file's bytes, if it is still the regular file of the size indexed (no more is ever read)."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise FileNotFoundError(key)
        return prefix_disk_dir.read_entry(self._path(key), entry.size)

    def _refuse(self, name: str, why: Exception) -> None:
        """Count a refused file and say why: its name (a hash), and the reason's own words only when they are
        this code's (never a value the file holds)."""
        self.stats.corrupt += 1
        ours = isinstance(why, (kv_file.FileError, NotAnEntry))
        text = str(why) if ours else why.strerror if isinstance(why, OSError) else ""
        log.warning("prefix_disk_file_refused", file=name[:80], why=f"{type(why).__name__}: {text}"[:200])

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _delete(self, key: str) -> None:
        self._forget(key)
        prefix_disk_dir.remove(self._path(key))


def _shared(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
