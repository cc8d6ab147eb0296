"""Shared-memory segments LMCache's CPU ``lmcache_driven`` transport leaves behind, removed.

On a machine without CUDA, LMCache's zero-copy transport moves vLLM's KV cache into a POSIX
shared-memory segment, ``/dev/shm/lmcache_kv_<pid>_<n>`` (``<pid>``: the vLLM worker that made
it, sized like its KV cache), which the LMCache server maps.  LMCache unlinks it when the tensor
is garbage-collected, which a worker that is stopped or killed never reaches: every vLLM run
left its whole KV cache in ``/dev/shm`` (RAM) until reboot.

Invariants
----------
* Only names LMCache's CPU transport makes (``lmcache_kv_<pid>_<n>``) are touched, only those
  this account owns, and only when their ``<pid>`` is not a running process: a live worker's
  segment is never removed.  A reused pid keeps a dead run's segment until that process ends
  too (a leak at worst, never a removal under a live process).
* Removing a name never takes memory from a process that still maps it (the LMCache server):
  ``unlink`` drops the name, the pages go when the last mapping does.
* Runs when kvpersist starts or stops a server and when ``kvp-vllm`` starts vLLM, so what
  earlier runs left is gone before the next one allocates its own.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"^lmcache_kv_(?P<pid>[0-9]+)_[0-9]+$")


@dataclass(frozen=True)
class Swept:
    segments: int
    bytes: int  # apparent size of the removed segments

    def __str__(self) -> str:
        return f"{self.segments} stale LMCache shared-memory segment(s), {self.bytes / 2**30:.2f} GiB"


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's process: running
        return True
    return True


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> Swept:
    """Remove the segments of dead LMCache CPU workers (module invariants); never raises for a
    segment that vanishes or cannot be removed meanwhile."""
    removed, total = 0, 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return Swept(0, 0)
    for entry in entries:
        match = SEGMENT_NAME.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.geteuid() or pid_running(int(match["pid"])):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
        total += st.st_size
    swept = Swept(removed, total)
    if removed:
        logger.info("kvpersist: removed %s", swept)
    return swept
