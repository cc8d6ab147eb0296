"""Publishing a cache file past the page cache (``O_DIRECT``), atomically.

Why: a store of many chunks written through the page cache fills it with dirty pages the device
must absorb anyway, and the kernel throttles the writers to the device's writeback (with a
loop device or a network file system, behind a second copy); the restore never reads those
pages back (its reads are ``O_DIRECT`` too).  ``raw_block`` writes ``O_DIRECT``; so does this.

Invariants
----------
* The same bytes as a buffered publish: the 4096-byte header at offset 0, the payload at 4096,
  the file exactly ``HEADER_SIZE + len(payload)`` bytes, written to a temp name and renamed
  (readers see no file or a complete one; a failure leaves no temp file).
* The payload goes to the device straight from the caller's buffer where it is page-aligned
  (LMCache's L1 objects are), whole pages at a time; the unaligned rest and the last partial
  page go through this thread's page-aligned bounce buffer, padded with zeros to a whole page,
  and the file is then truncated to its exact size.
* A file system that refuses ``O_DIRECT`` (``EINVAL`` at open or at a write) raises
  :class:`DirectWriteRefused` after removing the temp file; the caller publishes buffered.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from ..atomic import temp_name
from .format import HEADER_SIZE
from .read_loop import PAGE, is_page_aligned


class DirectWriteRefused(OSError):
    """The file system does not take ``O_DIRECT`` writes here."""


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_payload(fd: int, header: bytes, payload: memoryview, bounce: memoryview) -> bool:
    """Header and payload at their offsets; True when the last page was padded."""
    bounce[:HEADER_SIZE] = header
    _pwrite_all(fd, bounce[:HEADER_SIZE], 0)
    n = payload.nbytes
    head = n - n % PAGE if is_page_aligned(payload) else 0
    if head:
        _pwrite_all(fd, payload[:head], HEADER_SIZE)
    padded = False
    done = head
    while done < n:
        piece = payload[done:done + bounce.nbytes]
        size = piece.nbytes
        whole = -(-size // PAGE) * PAGE
        bounce[:size] = piece
        if whole > size:
            bounce[size:whole] = bytes(whole - size)
            padded = True
        _pwrite_all(fd, bounce[:whole], HEADER_SIZE + done)
        done += size
    return padded


def publish_direct(path: Path, header: bytes, payload: memoryview, bounce: memoryview, *,
                   fsync: bool, mode: int = 0o600,
                   before_rename: Callable[[], None] | None = None) -> None:
    """Write ``header`` + ``payload`` to ``path`` atomically with ``O_DIRECT`` (see the
    module invariants); ``bounce``: a page-aligned buffer of whole pages, at least one page.
    ``before_rename``: called once every byte is written; what it raises leaves no file and
    propagates."""
    if len(header) != HEADER_SIZE:
        raise ValueError(f"a header is {HEADER_SIZE} bytes, got {len(header)}")
    tmp = temp_name(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(tmp, flags, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectWriteRefused(exc.errno, exc.strerror, str(tmp)) from None
        raise
    try:
        try:
            if _write_payload(fd, header, payload, bounce):
                os.ftruncate(fd, HEADER_SIZE + payload.nbytes)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        os.rename(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
            raise DirectWriteRefused(exc.errno, exc.strerror, str(tmp)) from None
        raise
