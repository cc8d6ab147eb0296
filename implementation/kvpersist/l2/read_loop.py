"""Reading a file range in segments, each segment counted as it arrives (load progress) and, for
payloads, hashed right after its read.

The lookup deadline of a restore watches the server's ``read_bytes`` to tell a long load that
progresses from a stalled one, so a file's bytes must be counted segment by segment, not once
per file: a 16 MiB file on a 5 MiB/s device would otherwise show no progress for seconds per
reading thread.  And a restore reads thousands of files on many threads inside the LMCache
server, whose own Python threads want the GIL too: a Python loop takes the GIL back after every
segment and hashes while holding it, so the C loop releases it once for a whole payload.

Invariants
----------
* :func:`read_counted` fills ``out`` from ``offset`` until it is full or the file ends,
  ``segment`` bytes per ``pread`` (the C loop: to begin with; each read under 20 ms doubles the
  next, up to 2x, one over 100 ms puts it back to ``segment``: a fast device gets fewer,
  larger requests, a device slow from the start is counted as often as with fixed segments); it
  returns the bytes read (short only at end of file) and raises OSError for any other failure
  (EINTR is retried).  After each ``pread`` its byte count is added to the :class:`ReadCounter`
  before the next one starts; bytes read before a failure count too (progress, not success).
* :func:`read_hashed` reads the same way and also returns the XXH3-128 digest of exactly the
  bytes it put in ``out`` (:func:`kvpersist.l2.format.payload_digest` of them) and the seconds
  spent hashing.  With a ``bounce`` buffer (an O_DIRECT fd) the whole pages of a page-aligned
  ``out`` are read straight into it, everything else (a tail shorter than a page, or all of an
  unaligned ``out``) through ``bounce`` whole pages at a time, then copied; pages past the end
  of the file are never read, and the counter counts what each ``pread`` returned (the last
  bounce read's padding to a whole page included, none in a file that ends with ``out``).
* Two implementations keep that contract: the C loops of ``kvpersist.l2._readloop`` (used when
  built: the GIL released once per call, each count one atomic add on shared memory, the digest
  from the vendored xxHash) and the Python loops below (a lock per count).  One is chosen at
  import and used by every read of the process, so the two never add to one counter at once.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import xxhash

try:
    from . import _readloop  # type: ignore[attr-defined]
except ImportError:  # built optionally (setup.py); the Python loops keep the same contract
    _readloop = None

#: O_DIRECT alignment of offsets, lengths and buffers (a page covers every logical block size).
PAGE = 4096


class ReadCounter:
    """A count of bytes read, added to by any number of reading threads, readable at any time."""

    def __init__(self) -> None:
        self._cell = np.zeros(1, dtype=np.int64)  # 8-byte aligned, as the C loop's atomics need
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return int(self._cell[0])

    def add(self, nbytes: int) -> None:
        """The Python loops' count (the C loops add to :meth:`cell` themselves)."""
        with self._lock:
            self._cell[0] += nbytes

    def cell(self) -> Any:
        """The shared memory the C loops add to (a writable buffer of one int64)."""
        return self._cell


def has_c_loop() -> bool:
    """Whether the C loops are built (else every read runs the Python loops)."""
    return _readloop is not None


def read_counted(fd: int, out: memoryview, offset: int, segment: int,
                 counter: ReadCounter | None = None) -> int:
    """See the module invariants; without ``counter`` nothing is counted."""
    counter = _UNCOUNTED if counter is None else counter
    if _readloop is not None:
        got: int = _readloop.read_counted(fd, out, offset, segment, counter.cell())
        return got
    return python_read_counted(fd, out, offset, segment, counter)


def read_hashed(fd: int, out: memoryview, offset: int, segment: int,
                counter: ReadCounter | None = None, bounce: memoryview | None = None
                ) -> tuple[int, bytes, float]:
    """(bytes read, digest, hashing seconds); see the module invariants."""
    counter = _UNCOUNTED if counter is None else counter
    if _readloop is not None:
        got, digest, spent = _readloop.read_hashed(fd, out, offset, segment, counter.cell(),
                                                   bounce)
        return got, digest, spent
    return python_read_hashed(fd, out, offset, segment, counter, bounce)


def python_read_counted(fd: int, out: memoryview, offset: int, segment: int,
                        counter: ReadCounter) -> int:
    """The pure-Python :func:`read_counted` (the fallback, and the C loop's reference)."""
    if segment <= 0 or offset < 0:
        raise ValueError("read_counted: segment > 0, offset >= 0 and an aligned 8-byte cell")
    done = 0
    while done < out.nbytes:
        got = os.preadv(fd, [out[done:done + segment]], offset + done)
        if got <= 0:
            break
        done += got
        counter.add(got)
    return done


def python_read_hashed(fd: int, out: memoryview, offset: int, segment: int,
                       counter: ReadCounter, bounce: memoryview | None
                       ) -> tuple[int, bytes, float]:
    """The pure-Python :func:`read_hashed` (the fallback, and the C loop's reference)."""
    if bounce is not None and (bounce.nbytes < PAGE or bounce.nbytes % PAGE
                               or not is_page_aligned(bounce)):
        raise ValueError("read_hashed: a page-aligned bounce buffer of whole pages")
    hasher = xxhash.xxh3_128()
    spent = 0.0

    def hashed(piece: memoryview) -> None:
        nonlocal spent
        began = time.perf_counter()
        hasher.update(piece)
        spent += time.perf_counter() - began

    n = out.nbytes
    head = n if bounce is None else (n - n % PAGE if is_page_aligned(out) else 0)
    done = 0
    while done < head:
        want = min(segment, head - done)
        got = python_read_counted(fd, out[done:done + want], offset + done, segment, counter)
        hashed(out[done:done + got])
        done += got
        if got < want:
            return done, hasher.digest(), spent
    while bounce is not None and done < n:
        rest = min(n - done, bounce.nbytes)
        pages = -(-rest // PAGE) * PAGE
        part = min(python_read_counted(fd, bounce[:pages], offset + done, segment, counter), rest)
        hashed(bounce[:part])
        out[done:done + part] = bounce[:part]
        done += part
        if part < rest:
            break
    return done, hasher.digest(), spent


def is_page_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on a page boundary (O_DIRECT can read into it)."""
    return view.nbytes > 0 and int(np.frombuffer(view, np.uint8).ctypes.data) % PAGE == 0


#: Where reads nobody counts go (a file's header): one shared cell, not one per read.
_UNCOUNTED = ReadCounter()
