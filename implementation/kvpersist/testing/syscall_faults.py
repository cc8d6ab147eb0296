"""Injected system-call faults for the L2 store's model test: one failure of one call, by errno.

A fault replaces a function of the ``os`` module (or the store's read loop) for the duration of
a ``with`` block and fails the calls it matches; every other call goes through.  The store runs
its operations on the calling thread when opened with ``background_scan=False``, so a fault
hits exactly the operation inside the block.

Faults (:data:`FAULTS`): the open of a cache file for reading (EMFILE, ENFILE, EACCES, ESTALE,
ENAMETOOLONG, EIO), the read of its payload (EIO), the creation of a temp file (ENOSPC, EDQUOT,
EACCES, ENAMETOOLONG), a write into it (ENOSPC, EIO), the rename that publishes it (EIO, EXDEV),
and the unlink of a cache file (EIO, EACCES).  A rename or unlink fails only where its
source exists (the kernel looks the path up first); an open fails whether or not it does.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..l2 import files as files_module
from ..l2.layout import SUFFIX, is_temp_name


@dataclass(frozen=True)
class Fault:
    """Fail ``call`` (``open-read``, ``read``, ``open-write``, ``write``, ``rename``,
    ``unlink``) with ``code``."""

    call: str
    code: int

    def __str__(self) -> str:
        return f"{self.call}:{errno.errorcode[self.code]}"


FAULTS = [Fault("open-read", c) for c in (errno.EMFILE, errno.ENFILE, errno.EACCES,
                                          errno.ESTALE, errno.ENAMETOOLONG, errno.EIO)] + [
    Fault("read", errno.EIO),
    *(Fault("open-write", c) for c in (errno.ENOSPC, errno.EDQUOT, errno.EACCES,
                                       errno.ENAMETOOLONG)),
    Fault("write", errno.ENOSPC), Fault("write", errno.EIO),
    Fault("rename", errno.EIO), Fault("rename", errno.EXDEV),
    Fault("unlink", errno.EIO), Fault("unlink", errno.EACCES),
]


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def _name(path: Any) -> str:
    text = os.fspath(path) if not isinstance(path, int) else ""
    return os.path.basename(text) if isinstance(text, str) else ""


def _is_cache_path(path: Any) -> bool:
    """A cache file or its temp file (never the store's snapshot or anything else)."""
    name = _name(path)
    return name.endswith(SUFFIX) or is_temp_name(name)


@contextlib.contextmanager
def injected(fault: Fault) -> Iterator[list[int]]:
    """Fail every matching call inside the block; yields a list whose length is how many calls
    failed."""
    hits: list[int] = []
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, make(original))

    if fault.call in ("open-read", "open-write"):
        creating = fault.call == "open-write"

        def make_open(real: Any) -> Any:
            def fake(path: Any, flags: int, *args: Any, **kw: Any) -> int:
                if _is_cache_path(path) and bool(flags & os.O_CREAT) == creating:
                    hits.append(1)
                    raise _error(fault.code)
                return int(real(path, flags, *args, **kw))
            return fake
        patch(os, "open", make_open)
    elif fault.call == "read":
        def make_read(real: Any) -> Any:
            def fake(*args: Any, **kw: Any) -> Any:
                hits.append(1)
                raise _error(fault.code)
            return fake
        patch(files_module, "read_hashed", make_read)
    elif fault.call == "write":  # a buffered publish writes, an O_DIRECT one pwrites
        def make_write(real: Any) -> Any:
            def fake(fd: int, data: Any, *offset: int) -> int:
                hits.append(1)
                raise _error(fault.code)
            return fake
        patch(os, "write", make_write)
        patch(os, "pwrite", make_write)
    elif fault.call in ("rename", "unlink"):
        def make_path_call(real: Any) -> Any:
            def fake(*args: Any, **kw: Any) -> Any:
                if _is_cache_path(args[0]) and os.path.lexists(args[0]) and not (
                        fault.call == "unlink" and is_temp_name(_name(args[0]))):
                    hits.append(1)
                    raise _error(fault.code)
                return real(*args, **kw)
            return fake
        patch(os, fault.call, make_path_call)
    else:
        raise ValueError(f"unknown call {fault.call!r}")
    try:
        yield hits
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
