"""Making the next reads of cache files come from the device: the whole page cache dropped, or
only the pages of the files under one tree.

Invariants
----------
* Both write back first (``sync``): nothing dirty is lost, and the evicted pages are clean.
* :func:`evict_files` touches only the regular files under ``top`` (symlinks are not followed,
  a file that vanishes or cannot be opened is skipped): every other process's cached pages,
  its own code among them, stay.  On a serving node that is the considerate choice: a whole-
  cache drop makes vLLM and every other process fault its libraries back in for seconds.
* :func:`drop_page_cache` needs root (OSError otherwise); :func:`evict_files` only needs read
  access to the files.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: The ways ``kvp-admin recovery-test`` makes its restore cold (``--evict``).
EVICT_CHOICES = ("page-cache", "cache-files")


def drop_page_cache() -> None:
    """Write back and drop the whole page cache, so the next reads come from the device (root
    only; OSError otherwise)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def evict_files(top: Path) -> int:
    """Write back and evict the page cache of every file under ``top`` (and nothing else);
    returns how many files."""
    os.sync()
    count = 0
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    count += 1
                finally:
                    os.close(fd)
    return count
