"""One writer per cache root: an exclusive ``flock`` on ``<root>/.kvpersist.lock``.

Invariant: while a :class:`KvFileStore` is open on a root, it holds this lock, and the lock file
names the holder as ``pid@host``; a second store on the same root is refused with that name in
the message.  The lock is released when the descriptor is closed (also when the process dies).
On a shared tree each node's part is a root of its own, so this is one writer per node's part:
two servers of one node are refused, two nodes are not (``flock`` holds across the mounts of
GlusterFS, CephFS, Lustre and NFSv4; see docs/operations.md, "Sharing the tier across nodes").
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .layout import LOCK_NAME


class RootLockedError(RuntimeError):
    """Another process already serves this cache root."""


def holder_name() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def root_lock_holder(root: Path) -> str | None:
    """Who holds ``root``'s lock now (``pid@host``), or None when nobody does (probed with a
    non-blocking ``flock``, released at once; works from another node of a shared tree)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 128, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


def take_root_lock(root: Path) -> int:
    """The descriptor holding the root's lock; RootLockedError if another process holds it."""
    path = root / LOCK_NAME
    # The lock is held on a read-only descriptor: a file open for writing would keep the file
    # system from being remounted read-only, and a root turning read-only is a fault the tier
    # must see (kvpersist.l2.roots), not one the lock hides.
    writer = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RootLockedError(
                f"cache root {root} is already served by another kvpersist L2 store "
                f"({holder}); one writer per root: stop that server, or use another "
                "KVP_CACHE_ROOT (or, on a shared tree, another KVP_NODE_ID)"
            ) from None
        os.ftruncate(writer, 0)
        os.pwrite(writer, holder_name().encode(), 0)
    finally:
        os.close(writer)
    return fd
