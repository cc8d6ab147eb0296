"""One cache file at a time: atomic publish, verified read, scrub and quarantine.

Invariants
----------
* **Never wrong bytes**: :func:`read_verified` fills its buffer and returns only after the
  header (magic, version, header digest, exact key, payload length), the file size and the
  payload digest all check out; anything else raises :class:`FormatError` with a reason tag,
  and the buffer must then be treated as unfilled.
* **Atomic publish**: :func:`publish` writes through :func:`kvpersist.atomic.write_atomic`, or
  with ``O_DIRECT`` through :func:`kvpersist.l2.direct_write.publish_direct` (the same bytes):
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

from ..atomic import write_atomic
from .direct_write import publish_direct
from .format import HEADER_SIZE, build_header, check_header, parse_header, payload_digest
from .layout import QUARANTINE_DIR, FormatError, KeyFields, format_name, parse_name
from .read_loop import ReadCounter, read_counted, read_hashed

#: The smallest read of a payload: each one is hashed right after it and counted as progress.
VERIFY_SEGMENT = 1 << 20
_bounce = threading.local()
#: errno values that mean "the device is full": a rejected store, never an error.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_QUARANTINED = re.compile(r"^(?P<name>.+\.kvp)\.(?P<reason>[a-z][a-z0-9-]*)\.(?P<ns>[0-9]+)$")


def publish(path: Path, key: KeyFields, payload: memoryview, layout: dict[str, Any] | None,
            *, fsync: bool, direct: bool = False,
            before_rename: Callable[[], None] | None = None) -> None:
    """Write header and payload of ``key`` to ``path`` atomically; OSError on failure (no file
    and no temp file is left then).  ``direct``: past the page cache
    (:mod:`kvpersist.l2.direct_write`; :class:`~kvpersist.l2.direct_write.DirectWriteRefused`
    where the file system does not take it).  ``before_rename``: called after the payload's
    last byte was read (hashed and written); what it raises leaves no file and propagates."""
    header = build_header(key, payload.nbytes, payload_digest(payload), layout)
    if direct:
        publish_direct(path, header, payload, _bounce_buffer(), fsync=fsync,
                       before_rename=before_rename)
    else:
        write_atomic(path, (header, payload), fsync=fsync, before_rename=before_rename)


def read_verified(fd: int, key: KeyFields, out: memoryview,
                  progress: ReadCounter | None = None, *, direct: bool = False,
                  file_size: int | None = None) -> float:
    """Fill ``out`` from the open file ``fd`` if, and only if, it is exactly ``key``'s object.

    The payload is read in segments of at least :data:`VERIFY_SEGMENT` (the C loop grows them on
    a fast device), each added to ``progress`` as it arrives and hashed right after its read
    (:func:`~kvpersist.l2.read_loop.read_hashed`: one GIL release for the whole payload where
    the C loop is built).  Buffered reads ask the kernel to read the whole payload ahead
    (``POSIX_FADV_WILLNEED``).  Returns the seconds spent on the payload digest.  Raises
    FormatError (reason tag) otherwise.  ``file_size``: the file's size where the caller
    already stat'ed it (else it is stat'ed here).
    """
    bounce = _bounce_buffer() if direct else None
    if bounce is not None:
        raw = bytes(bounce[:read_counted(fd, bounce[:HEADER_SIZE], 0, HEADER_SIZE)])
    else:
        raw = os.pread(fd, HEADER_SIZE, 0)
    header = parse_header(raw)
    check_header(header, key, out.nbytes)
    if file_size is None:
        file_size = os.fstat(fd).st_size
    if file_size != HEADER_SIZE + out.nbytes:
        raise FormatError("size-mismatch", f"{file_size} bytes on disk")
    if bounce is None and out.nbytes > VERIFY_SEGMENT:
        os.posix_fadvise(fd, HEADER_SIZE, out.nbytes, os.POSIX_FADV_WILLNEED)
    got, digest, spent = read_hashed(fd, out, HEADER_SIZE, VERIFY_SEGMENT, progress, bounce)
    if got < out.nbytes:
        raise FormatError("truncated", f"{got} of {out.nbytes} bytes")
    if digest != header.checksum:
        raise FormatError("payload-checksum")
    return spent


def verify_file(path: Path, key: KeyFields | None = None) -> tuple[str | None, int]:
    """Scrub one ``.kvp`` file against ``key`` (default: the key its name says); returns
    (failure reason or None, bytes read)."""
    if key is None:
        try:
            key = parse_name(path.name)
        except FormatError as exc:
            if exc.reason != "hashed-name":
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
        if key is None:  # a hashed name: the header names the key, which must name the file
            if format_name(header.key) != path.name:
                return "key-mismatch", 0
            key = header.key
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
