"""What a process tree holds right now, read from ``/proc``: the figures a long run watches for
leaks (memory, threads, open files) and the host's Python shared-memory segments.

Invariants
----------
* A tree is a root pid and every descendant alive at the moment of the walk; a process that
  exits mid-walk is skipped, never an error.
* Memory is PSS (proportional set size, ``smaps_rollup``): pages shared between the tree's
  processes (vLLM's shared KV segments, the libraries) count once in the sum, not once per
  process as RSS would.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

PROC = Path("/proc")
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class TreeUsage:
    """The sum over a process tree (zeros when its root is gone)."""

    processes: int
    pss_bytes: int
    threads: int
    open_fds: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: the fields after its ')'
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def tree_pids(root: int) -> list[int]:
    """``root`` and its living descendants (empty when ``root`` is gone)."""
    if not (PROC / str(root)).exists():
        return []
    children = _children_of()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _pss_bytes(pid: int) -> int:
    for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _threads(pid: int) -> int:
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def tree_usage(root: int | None) -> TreeUsage:
    """The usage of ``root``'s tree now."""
    if root is None:
        return TreeUsage(0, 0, 0, 0)
    processes = pss = threads = fds = 0
    for pid in tree_pids(root):
        try:
            pss += _pss_bytes(pid)
            threads += _threads(pid)
            fds += len(os.listdir(PROC / str(pid) / "fd"))
        except OSError:  # exited during the walk
            continue
        processes += 1
    return TreeUsage(processes, pss, threads, fds)


@dataclass(frozen=True)
class ShmUsage:
    """Shared-memory segments in ``/dev/shm`` (all, or those whose name starts with a prefix:
    ``psm_`` is Python's): how many, and the bytes they occupy (allocated pages, not their
    apparent size)."""

    segments: int
    allocated_bytes: int


def shm_usage(prefix: str = "") -> ShmUsage:
    count = allocated = 0
    try:
        entries = list(SHM.iterdir())
    except OSError:
        return ShmUsage(0, 0)
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            allocated += entry.stat().st_blocks * 512
        except OSError:
            continue
        count += 1
    return ShmUsage(count, allocated)
