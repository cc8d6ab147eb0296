"""One writer per cache root: an exclusive ``flock`` on ``<root>/.kvpersist.lock``.

Invariant: while a :class:`KvFileStore` is open on a root, it holds this lock, and the lock file
names the holder's pid; a second store on the same root is refused with that pid in the message.
The lock is released when the descriptor is closed (also when the process dies).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .layout import LOCK_NAME


class RootLockedError(RuntimeError):
    """Another process already serves this cache root."""


def take_root_lock(root: Path) -> int:
    """The descriptor holding the root's lock; RootLockedError if another process holds it."""
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RootLockedError(
            f"cache root {root} is already served by another kvpersist L2 store "
            f"(pid {holder}); one writer per root: stop that server or use another KVP_CACHE_ROOT"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
