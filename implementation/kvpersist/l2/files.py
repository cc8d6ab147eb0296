"""One cache file at a time: atomic publish, verified read, scrub and quarantine.

Invariants
----------
* **Never wrong bytes**: :func:`read_verified` fills its buffer and returns only after the
  header (magic, version, header digest, exact key, payload length), the file size and the
  payload digest all check out; anything else raises :class:`FormatError` with a reason tag,
  and the buffer must then be treated as unfilled.
* **Atomic publish**: :func:`publish` writes through :func:`kvpersist.atomic.write_atomic`:
  readers see no file or a complete one, and a failed write leaves no temp file.
* **Direct reads** (``direct=True``, the fd opened with ``O_DIRECT``): the same checks on the
  same bytes; the payload (at offset 4096) is read straight into the caller's buffer where it is
  page-aligned, through a per-thread page-aligned bounce buffer where it is not and for a tail
  shorter than a page; the page cache is neither filled nor read.
* Quarantine moves a file into ``<root>/quarantine/`` as ``<name>.<reason>.<ns>``; nothing in
  there is ever read as data.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_atomic
from .format import HEADER_SIZE, build_header, check_header, parse_header, payload_digest, payload_hasher
from .layout import QUARANTINE_DIR, FormatError, KeyFields, parse_name

#: Bytes hashed right after each read, while they are still in the CPU cache.
VERIFY_SEGMENT = 1 << 20
#: Alignment of O_DIRECT offsets, lengths and buffers (a page covers every logical block size).
DIRECT_ALIGN = 4096
_bounce = threading.local()
#: errno values that mean "the device is full": a rejected store, never an error.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_QUARANTINED = re.compile(r"^(?P<name>.+\.kvp)\.(?P<reason>[a-z][a-z0-9-]*)\.(?P<ns>[0-9]+)$")


def publish(path: Path, key: KeyFields, payload: memoryview, layout: dict[str, Any] | None,
            *, fsync: bool) -> None:
    """Write header and payload of ``key`` to ``path`` atomically; OSError on failure (no file
    and no temp file is left then)."""
    header = build_header(key, payload.nbytes, payload_digest(payload), layout)
    write_atomic(path, (header, payload), fsync=fsync)


def read_verified(fd: int, key: KeyFields, out: memoryview,
                  on_read: Callable[[int], None] | None = None, *, direct: bool = False) -> float:
    """Fill ``out`` from the open file ``fd`` if, and only if, it is exactly ``key``'s object.

    The kernel is asked to read the whole payload ahead (``POSIX_FADV_WILLNEED``), so the device
    has the file's reads in flight while earlier segments are hashed.  ``on_read(n)`` is called
    after each segment (progress).  Returns the seconds spent on the payload digest.  Raises
    FormatError (reason tag) otherwise.
    """
    if direct:
        bounce = _bounce_buffer()
        raw = bytes(bounce[:read_into(fd, bounce[:HEADER_SIZE], 0)])
    else:
        raw = os.pread(fd, HEADER_SIZE, 0)
    header = parse_header(raw)
    check_header(header, key, out.nbytes)
    file_size = os.fstat(fd).st_size
    if file_size != HEADER_SIZE + out.nbytes:
        raise FormatError("size-mismatch", f"{file_size} bytes on disk")
    if out.nbytes > VERIFY_SEGMENT and not direct:
        os.posix_fadvise(fd, HEADER_SIZE, out.nbytes, os.POSIX_FADV_WILLNEED)
    hasher = payload_hasher()
    spent = 0.0
    done = 0
    while done < out.nbytes:
        segment = out[done:done + VERIFY_SEGMENT]
        if direct:
            got = _read_direct(fd, segment, HEADER_SIZE + done)
        else:
            got = read_into(fd, segment, HEADER_SIZE + done)
        began = time.perf_counter()
        hasher.update(segment[:got])
        spent += time.perf_counter() - began
        done += got
        if on_read is not None:
            on_read(got)
        if got < segment.nbytes:
            raise FormatError("truncated", f"{done} of {out.nbytes} bytes")
    if hasher.digest() != header.checksum:
        raise FormatError("payload-checksum")
    return spent


def verify_file(path: Path, key: KeyFields | None = None) -> tuple[str | None, int]:
    """Scrub one ``.kvp`` file against ``key`` (default: the key its name says); returns
    (failure reason or None, bytes read)."""
    if key is None:
        try:
            key = parse_name(path.name)
        except FormatError as exc:
            return exc.reason, 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"unreadable ({exc.strerror})", 0
    try:
        try:
            header = parse_header(os.pread(fd, HEADER_SIZE, 0))
        except FormatError as exc:
            return exc.reason, 0
        buf = bytearray(max(0, min(header.payload_len, os.fstat(fd).st_size)))
        try:
            read_verified(fd, key, memoryview(buf))
        except FormatError as exc:
            return exc.reason, len(buf)
        return None, HEADER_SIZE + len(buf)
    finally:
        os.close(fd)


def quarantine_file(root: Path, path: Path, reason: str) -> Path:
    """Move ``path`` into ``root/quarantine`` with the reason in its name; returns the target."""
    qdir = root / QUARANTINE_DIR
    qdir.mkdir(mode=0o700, exist_ok=True)
    target = qdir / f"{path.name}.{reason}.{time.time_ns()}"
    os.rename(path, target)
    return target


def quarantined_origin(name: str) -> tuple[str, str] | None:
    """(original cache-file name, reason) of a quarantined file's name, or None."""
    match = _QUARANTINED.match(name)
    return None if match is None else (match["name"], match["reason"])


def _bounce_buffer() -> memoryview:
    """This thread's page-aligned buffer of one verify segment (anonymous mmap)."""
    view: memoryview | None = getattr(_bounce, "view", None)
    if view is None:
        _bounce.map = mmap.mmap(-1, VERIFY_SEGMENT)
        view = _bounce.view = memoryview(_bounce.map)
    return view


def is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on a page boundary (O_DIRECT can read into it)."""
    return view.nbytes > 0 and int(np.frombuffer(view, np.uint8).ctypes.data) % DIRECT_ALIGN == 0


def _read_direct(fd: int, segment: memoryview, offset: int) -> int:
    """Read ``segment`` (at most one verify segment) at the page-aligned ``offset`` of an
    O_DIRECT fd: the aligned whole pages straight into it, the rest through the bounce buffer;
    returns how many bytes (short only at EOF)."""
    n = segment.nbytes
    head = n - n % DIRECT_ALIGN if is_aligned(segment) else 0
    got = read_into(fd, segment[:head], offset) if head else 0
    if got < head or head == n:
        return got
    rest = n - head
    bounce = _bounce_buffer()
    tail = read_into(fd, bounce[:-(-rest // DIRECT_ALIGN) * DIRECT_ALIGN], offset + head)
    tail = min(tail, rest)
    segment[head:head + tail] = bounce[:tail]
    return got + tail


def read_into(fd: int, out: memoryview, offset: int) -> int:
    """Read up to ``out.nbytes`` bytes at ``offset``; returns how many (short only at EOF)."""
    total = 0
    while total < out.nbytes:
        n = os.preadv(fd, [out[total:]], offset + total)
        if n <= 0:
            break
        total += n
    return total
