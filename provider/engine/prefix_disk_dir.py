"""The disk tier's directory, its key, and how its files are opened (issue 56).

The tier owns its directory: created 0700; an existing one this user owns has any access for others taken away
(fixed and logged); one another user owns is refused (DiskDirError, which `provider start` reports as one
line). Inside it, only regular files are entries: a name that is a symlink, a FIFO, a device or a directory is
never opened (opens use O_NOFOLLOW and O_NONBLOCK, then fstat), and a read takes exactly the bytes the index
holds for the file, never more.

The key authenticates every file (kv_file: HMAC-SHA256): 32 random bytes in the state directory, 0600,
made on first use. A key others can read or write, a symlink, or a key of another length is refused as the
node's identity key is (coordinator_client.identity): a file's MAC is only worth what the key's secrecy is.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from .. import logs, paths

log = logs.get("engine")
KEY_FILE = "prefix-disk.key"
KEY_BYTES = 32
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class DiskDirError(PermissionError):
    """The directory or the key cannot be trusted; the node refuses to start (one line, exit 1)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotAnEntry(OSError):
    """A name in the directory that is no regular file of the size the index holds."""


def own(root: Path) -> Path:
    """`root` made (0700) or checked: a directory this user owns that nobody else can enter, read or write."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    root = root.resolve()  # the operator's own symlink to the directory is theirs; its files' are not followed
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskDirError(f"prefix_disk_dir {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise DiskDirError(f"prefix_disk_dir {root} belongs to uid {st.st_uid}, not to this user (uid "
                           f"{os.geteuid()}); point prefix_disk_dir at a directory of this user's")
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
        log.warning("prefix_disk_dir_fixed", was=f"{st.st_mode & 0o777:o}", now="700")
    return root


def load_key(state_dir: Path | None = None) -> bytes:
    """The tier's key, made on first use; refused when it is not a private regular file of 32 bytes."""
    path = (state_dir or paths.state_dir()) / KEY_FILE
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        paths.write_private(path, key)
        return key
    if not stat.S_ISREG(st.st_mode):
        raise DiskDirError(f"{path} is not a regular file; remove it (the disk tier's files are then refused "
                           "and deleted)")
    if st.st_mode & 0o077:
        raise DiskDirError(f"{path} is readable or writable by other users (mode {st.st_mode & 0o777:o}); run "
                           f"`chmod 600 {path}`")
    with open(path, "rb", opener=lambda p, flags: os.open(p, _OPEN)) as f:
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise DiskDirError(f"{path} is not a key of {KEY_BYTES} bytes; remove it (the disk tier's files are then "
                           "refused and deleted)")
    return key


def open_entry(path: Path):
    """A binary file object on `path` if it is a regular file (no symlink followed, no FIFO waited on)."""
    fd = os.open(path, _OPEN)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAnEntry("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_entry(path: Path, size: int) -> bytes:
    """The whole of a regular file that still has the size the index holds for it, and not a byte more."""
    with open_entry(path) as f:
        if os.fstat(f.fileno()).st_size != size:
            raise NotAnEntry("its size is not the one indexed")
        data = f.read(size)
    if len(data) != size:
        raise NotAnEntry("shorter than its size")
    return data


def create_new(path: Path) -> int:
    """A new file (0600) at `path` for writing, never through a name someone left there."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


def names(root: Path, suffix: str) -> tuple[list[str], list[str]]:
    """The names in `root` ending in `suffix`: those of regular files, and the others (to be removed)."""
    regular, other = [], []
    with os.scandir(root) as it:
        for e in it:
            if e.name.endswith(suffix):
                (regular if e.is_file(follow_symlinks=False) else other).append(e.name)
    return regular, other


def remove(path: Path) -> None:
    """Unlink `path` (a symlink itself, never its target); a directory in its place is left, logged."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("prefix_disk_remove_failed", file=path.name, error=e.strerror)
