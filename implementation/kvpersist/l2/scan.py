"""The start-up scan: what the data directories of a root hold, by names and sizes only.

Invariants
----------
* Only data directories count (:func:`kvpersist.l2.layout.is_data_dir`): the root and, when
  sharded, ``root/xx/yy``; ``quarantine/`` and operator folders are never data.
* Only ``.kvp`` files whose names parse are data; unparsable ``.kvp`` names are counted.
* Keys come back least recently used first (file mtime = last access), so announcing them in
  that order restores LMCache's LRU order after a restart.
* Temp leftovers in data directories are removed only when ``remove_temps`` is set: by the
  store that holds the root's lock, never by a reader.
* A walk that could not read a data directory, or stat an entry of one (EIO, ESTALE, EACCES,
  ...), fails (:class:`~kvpersist.l2.inventory.InventoryError`): a partial walk would leave
  files outside the count and the cap.  An entry that vanished between the listing and its stat
  (ENOENT) was not there to count; errors outside the data directories (quarantine, operator
  folders) do not fail it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .inventory import (
    LIVE,
    TEMP,
    UNPARSABLE,
    Inventory,
    InventoryError,
    build_inventory,
    index_of_columns,
)
from .layout import SUFFIX, KeyFields, is_data_dir

#: The two kinds of line a walker reports (``<what> <path>: <strerror>``).
_UNREAD_DIR = "cannot read directory "
_UNSTATTED = "cannot stat "
#: How many unread entries a failed scan names.
_NAMED = 3


def unread_data(errors: list[str], root: Path, *, sharded: bool) -> list[str]:
    """The walker's error lines that leave part of the data unread (see the invariants)."""
    base = str(root)
    vanished = os.strerror(errno.ENOENT)

    def holds_data(directory: str) -> bool:
        if is_data_dir(base, directory, sharded):
            return True
        # the first shard level (root/xx) leads to data directories
        rest = directory[len(base) + 1:] if directory.startswith(base + "/") else ""
        return sharded and len(rest) == 2 and "/" not in rest

    unread = []
    for line in errors:
        where, _, why = line.rpartition(": ")
        if why == vanished:
            continue
        if where.startswith(_UNREAD_DIR):
            directory = where[len(_UNREAD_DIR):]
        elif where.startswith(_UNSTATTED):
            directory = os.path.dirname(where[len(_UNSTATTED):])
        else:
            continue
        if holds_data(directory):
            unread.append(line)
    return unread


@dataclass
class ScanResult:
    files: dict[KeyFields, int]  # key -> accounted size, least recently used first
    temp_files: list[str]  # temp leftovers found in data directories
    temp_removed: int
    unparsable_names: int


@dataclass
class TreeWalk:
    """A walk's inventory and what a scan takes from it, as columns (no Python object per
    file): ``live`` are the rows of the data directories' ``.kvp`` files whose names parse,
    least recently used first."""

    inventory: Inventory
    live: npt.NDArray[np.int64]
    temp_files: list[str]
    temp_removed: int
    unparsable_names: int


def walk_root(root: Path, *, sharded: bool, remove_temps: bool, walker: str = "auto",
              walk_threads: int = 0) -> TreeWalk:
    """Walk ``root`` with :mod:`kvpersist.l2.inventory`'s ``walker`` (``auto``: C when built;
    the caller's setting, never read from the environment here)."""
    inv = build_inventory(root, walker=walker, threads=walk_threads)
    unread = unread_data(inv.errors, root, sharded=sharded)
    if unread:
        raise InventoryError(f"the walk of {root} could not read {len(unread)} entr"
                             f"{'y' if len(unread) == 1 else 'ies'} of its data: "
                             + "; ".join(unread[:_NAMED]) + ("; ..." if len(unread) > _NAMED
                                                             else ""))
    base = str(root)
    data = np.array([is_data_dir(base, d, sharded) for d in inv.dirs], bool)[inv.dir_idx] \
        if inv.dirs else np.zeros(0, bool)
    temps = [inv.file(int(row)).fspath for row in np.flatnonzero(data & (inv.cls == TEMP))]
    removed = 0
    if remove_temps:
        for path in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    # ".kvp", not nixl_store_dynamic's ".bin": the third byte from each name's end (only read
    # for live/unparsable rows, whose names end in one of the two suffixes).
    kvp = np.frombuffer(inv.names, np.uint8)[np.maximum(inv.name_end - 3, 0)] == ord(SUFFIX[1]) \
        if len(inv) else np.zeros(0, bool)
    unparsable = int(np.count_nonzero(data & kvp & (inv.cls == UNPARSABLE)))
    live = np.flatnonzero(data & kvp & (inv.cls == LIVE))
    live = live[np.argsort(inv.mtime_ns[live], kind="stable")]  # oldest access first = LRU
    return TreeWalk(inv, live.astype(np.int64), temps, removed, unparsable)


def scan_root(root: Path, *, sharded: bool, remove_temps: bool, walker: str = "auto",
              walk_threads: int = 0) -> ScanResult:
    """:func:`walk_root`, with the live files' keys made."""
    walk = walk_root(root, sharded=sharded, remove_temps=remove_temps, walker=walker,
                     walk_threads=walk_threads)
    inv = walk.inventory
    files = index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names, walk.live,
                             inv.size[walk.live])
    return ScanResult(files, walk.temp_files, walk.temp_removed, walk.unparsable_names)
