"""Shared-memory segments LMCache's CPU ``lmcache_driven`` transport and vLLM's processes leave
behind, removed.

On a machine without CUDA, LMCache's zero-copy transport moves vLLM's KV cache into a POSIX
shared-memory segment, ``/dev/shm/lmcache_kv_<pid>_<n>`` (``<pid>``: the vLLM worker that made
it, sized like its KV cache), which the LMCache server maps.  LMCache unlinks it when the tensor
is garbage-collected, which a worker that is stopped or killed never reaches: every vLLM run
left its whole KV cache in ``/dev/shm`` (RAM) until reboot.

Invariants
----------
* Only names LMCache's CPU transport makes (``lmcache_kv_<pid>_<n>``) are touched, only those
  this account owns, and only when their owner is proven dead: ``<pid>`` is not a running
  process *and* no process maps the segment or holds it open.  A reused pid keeps a dead run's
  segment until that process ends too (a leak at worst, never a removal under a live process).
* A pid means nothing across pid namespaces (containers sharing ``/dev/shm``, ``--ipc=host``):
  the proof needs every process of the machine in view, which only the initial pid namespace
  has.  Anywhere else nothing is removed, and one line says how much was left and why.
* Removing a name never takes memory from a process that still maps it (the LMCache server):
  ``unlink`` drops the name, the pages go when the last mapping does.
* Runs when kvpersist starts or stops a server and when ``kvp-vllm`` starts vLLM, so what
  earlier runs left is gone before the next one allocates its own.
* Segments that carry no pid (:func:`python_segments`): Python's default-named segments
  (``psm_<8 hex>``, ``multiprocessing.shared_memory``: vLLM's message queues, 16-24 MiB each,
  one per executor and worker), ``multiprocessing``'s named semaphores (``sem.mp-<8>``, made
  for its spawn-context locks and queues) and vLLM's CPU communicator buffers for tensor and
  pipeline parallelism (``vllm_dist_<32 hex>-<group>-cpushm_<rank>``, 4 MiB each).  A process
  group killed with SIGKILL (the resource tracker with it) leaves the first two; TP and PP
  engines stopped here left the third.  They are removed only when this account owns
  them, every process is in view, no process maps or holds them open, and they are older
  than a grace period (:data:`PYTHON_SEGMENT_GRACE_S`) or were made by a run the caller
  itself ended (``only``; another run beside it maps its own from the moment it makes them).
* "In use" is decided by the file, not only by its name: glibc maps a new semaphore under a
  temporary name (``sem.XXXXXX``, then linked to its own name and unlinked), so its creator's
  maps show another name for the same inode.  A file whose inode any process maps or holds
  open is in use whatever name shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"^lmcache_kv_(?P<pid>[0-9]+)_[0-9]+$")
#: Python's default name of a ``multiprocessing.shared_memory`` segment.
PYTHON_SEGMENT_NAME = re.compile(r"^psm_[0-9a-f]{8}$")
#: ``multiprocessing``'s named semaphores (``/mp-`` and 8 of ``[a-z0-9_]``, in ``/dev/shm`` as
#: ``sem.mp-...``).
SEMAPHORE_NAME = re.compile(r"^sem\.mp-[a-z0-9_]{8}$")
#: vLLM's CPU shared-memory communicator (``csrc/cpu/shm.cpp``) of a TP or PP group.
VLLM_CPU_COMM_NAME = re.compile(r"^vllm_dist_[0-9a-f]{32}-.+-cpushm_[0-9]+$")
#: Every pid-less name :func:`sweep_python_segments` may remove.
PIDLESS_NAMES = (PYTHON_SEGMENT_NAME, SEMAPHORE_NAME, VLLM_CPU_COMM_NAME)
#: How old an unmapped Python segment must be before a sweep that did not end its run takes it.
PYTHON_SEGMENT_GRACE_S = 600.0
#: The inode of the initial pid namespace (the kernel's ``PROC_PID_INIT_INO``).
INITIAL_PID_NS_INODE = 0xEFFFFFFC


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


def sees_every_process() -> bool:
    """Whether this process is in the initial pid namespace, where every process is in view."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INITIAL_PID_NS_INODE
    except OSError:
        return False


def segments_in_use(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names under ``shm_dir`` that a process in view maps or holds open, by name or by inode
    (module invariants; processes of other accounts are skipped where they cannot be read:
    they cannot be the owner of this account's segments, which are created with mode 0600)."""
    prefix = str(shm_dir) + "/"
    try:
        device = os.stat(shm_dir).st_dev
    except OSError:
        return set()
    used: set[str] = set()
    inodes: set[int] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8",
                                                errors="replace") as maps:
            for line in maps:
                at = line.find(prefix)
                if at < 0:
                    continue
                used.add(line[at + len(prefix):].split()[0])
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                major, _, minor = fields[3].partition(":")
                with contextlib.suppress(ValueError):
                    if os.makedev(int(major, 16), int(minor, 16)) == device:
                        inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix):].split()[0])
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        if st.st_dev == device:
                            inodes.add(st.st_ino)
    if inodes:
        with contextlib.suppress(OSError):
            used.update(e.name for e in os.scandir(shm_dir)
                        if e.inode() in inodes and not e.is_dir(follow_symlinks=False))
    return used


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> Swept:
    """Remove the segments of dead LMCache CPU workers (module invariants); never raises for a
    segment that vanishes or cannot be removed meanwhile.  Processes are looked through only
    when a segment of this account names a pid that is gone."""
    try:
        entries = [e for e in os.scandir(shm_dir) if SEGMENT_NAME.match(e.name)]
    except OSError:
        return Swept(0, 0)
    candidates: list[tuple[os.DirEntry[str], int]] = []
    for entry in entries:
        match = SEGMENT_NAME.match(entry.name)
        assert match is not None
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.geteuid() and not pid_running(int(match["pid"])):
            candidates.append((entry, st.st_size))
    if not candidates:
        return Swept(0, 0)
    if not sees_every_process():
        logger.info("kvpersist: %d LMCache shared-memory segment(s) in %s left alone: this "
                    "process does not see every process (a container's pid namespace), so it "
                    "cannot prove their owners dead", len(candidates), shm_dir)
        return Swept(0, 0)
    in_use = segments_in_use(shm_dir)
    removed, total = 0, 0
    for entry, size in candidates:
        if entry.name in in_use:
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
        total += size
    swept = Swept(removed, total)
    if removed:
        logger.info("kvpersist: removed %s", swept)
    return swept


def python_segments(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names under ``shm_dir`` that carry no pid (:data:`PIDLESS_NAMES`: Python's segments
    and semaphores, vLLM's CPU communicator buffers)."""
    try:
        return {e.name for e in os.scandir(shm_dir)
                if any(pattern.match(e.name) for pattern in PIDLESS_NAMES)}
    except OSError:
        return set()


def sweep_python_segments(shm_dir: Path = SHM_DIR, *, only: set[str] | None = None,
                          grace_s: float = PYTHON_SEGMENT_GRACE_S,
                          now: float | None = None) -> Swept:
    """Remove orphaned Python segments (module invariants): among ``only`` (names a run the
    caller ended made) whatever nobody uses; otherwise only those whose last change (mtime and
    ctime: the latter no one can set back) is older than ``grace_s`` before ``now``."""
    now = time.time() if now is None else now
    candidates: list[tuple[str, int]] = []
    for name in python_segments(shm_dir) if only is None else only & python_segments(shm_dir):
        try:
            st = os.stat(shm_dir / name, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.geteuid():
            continue
        if only is None and now - max(st.st_mtime, st.st_ctime) < grace_s:
            continue
        candidates.append((name, st.st_size))
    if not candidates or not sees_every_process():
        return Swept(0, 0)
    in_use = segments_in_use(shm_dir)
    removed, total = 0, 0
    for name, size in candidates:
        if name in in_use:
            continue
        with contextlib.suppress(OSError):
            os.unlink(shm_dir / name)
            removed += 1
            total += size
    swept = Swept(removed, total)
    if removed:
        logger.info("kvpersist: removed %d orphaned shared-memory name(s) of Python and vLLM "
                    "(%.2f GiB)",
                    removed, total / 2**30)
    return swept
