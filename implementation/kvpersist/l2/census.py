"""Files and bytes in ``quarantine/``, counted off the request path.

Invariant: :meth:`QuarantineCensus.get` never touches the disk.  ``/status`` is how the
connector's progress probe tells a progressing restore from a stalled server; a ``scandir`` on
the status path waited behind the restore's own reads on a throttled device (seen under CI: 0
of 2 probe polls answered within 2 s, and a progressing restore was bypassed as a stall).  The
count is refreshed in the background when older than ``max_age_s``, and adjusted at once for
the quarantine moves this process makes itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


class QuarantineCensus:
    def __init__(self, directory: Path, *, max_age_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._files = self._bytes = 0
        self._counted_at = float("-inf")
        self._refreshing = False

    def count_now(self) -> tuple[int, int]:
        """Count synchronously (start-up, tests); returns (files, bytes)."""
        files = size = 0
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                files += 1
                with contextlib.suppress(OSError):
                    size += entry.stat(follow_symlinks=False).st_size
        with self._lock:
            self._files, self._bytes, self._counted_at = files, size, self._clock()
            self._refreshing = False
        return files, size

    def get(self) -> tuple[int, int]:
        """The last count (files, bytes); starts a background recount when it is stale."""
        with self._lock:
            stale = self._clock() - self._counted_at > self.max_age_s and not self._refreshing
            if stale:
                self._refreshing = True
            value = (self._files, self._bytes)
        if stale:
            threading.Thread(target=self.count_now, name="kvpersist-quarantine-census",
                             daemon=True).start()
        return value

    def added(self, nbytes: int) -> None:
        """This process moved a file of ``nbytes`` into quarantine."""
        with self._lock:
            self._files += 1
            self._bytes += nbytes
