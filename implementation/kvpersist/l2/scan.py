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
* A live name whose key is not all in the name (:func:`kvpersist.l2.layout.needs_header`: a
  hashed part, or an earlier version's ambiguous name) takes its key from the file's header; the
  store that owns the root renames an earlier version's name to the one this version writes
  (counted in ``migrated_names``; one already there wins and the old file goes to quarantine as
  ``superseded``), a reader leaves it alone.  Such files come after the others in the LRU order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..identity import IdentityError
from ..identity.records import read_record
from .files import quarantine_file
from .format import HEADER_SIZE, parse_header
from .inventory import (
    LIVE,
    TEMP,
    UNPARSABLE,
    Inventory,
    InventoryError,
    build_inventory,
    index_of_columns,
)
from .layout import (
    MAX_NAME_BYTES,
    SUFFIX,
    FormatError,
    KeyFields,
    format_name,
    is_data_dir,
    legacy_name,
    parse_name,
    shard_path_parts,
    split_model_name,
)

logger = logging.getLogger("kvpersist.l2")

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
    migrated_names: int = 0


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
    #: live rows whose keys are not all in their names (``live`` excludes them)
    odd: npt.NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64))


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
    odd = _odd_rows(root, inv, live)
    return TreeWalk(inv, live[~odd].astype(np.int64), temps, removed, unparsable,
                    live[odd].astype(np.int64))


def _recorded_elsewhere(root: Path, inv: Inventory) -> set[int]:
    """Models whose name reads as a valid name of another model: an earlier version wrote
    ``team--x/chat`` as ``team--x--chat``, which this version reads as ``team/x/chat``.  The
    namespace's identity record (written by the connector) names the real model; where it
    differs only in how ``/`` and ``--`` spell the same file name, the header decides."""
    found = set()
    for m, model_name in enumerate(inv.model_names):
        namespace = split_model_name(model_name)[0]
        if not namespace or m in inv.inexact_models:
            continue
        try:
            recorded = read_record(root, namespace).lmcache_model_name()
        except IdentityError:
            continue
        if recorded != model_name and recorded.replace("/", "--") == model_name.replace("/", "--"):
            found.add(m)
    return found


def _odd_rows(root: Path, inv: Inventory, live: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
    """Which of the ``live`` rows need more than the C key parser (a mask): a name longer than
    this version writes, an inexact model part (or one its identity record contradicts), or an
    escaped or hashed salt (``@%``, found at C speed in the names' bytes)."""
    odd = np.diff(inv.name_end, prepend=0)[live] > MAX_NAME_BYTES  # an earlier version's
    inexact = inv.inexact_models | _recorded_elsewhere(root, inv)
    if inexact:
        odd |= np.isin(inv.model_idx[live], np.array(sorted(inexact), np.int32))
    names = bytes(inv.names)
    starts, at = [], names.find(b"@%")
    while at >= 0:
        starts.append(at)
        at = names.find(b"@%", at + 2)
    if starts:
        rows = np.searchsorted(inv.name_end, np.array(starts, np.int64), side="right")
        odd |= np.isin(live, rows)
    return odd


def scan_root(root: Path, *, sharded: bool, remove_temps: bool, walker: str = "auto",
              walk_threads: int = 0) -> ScanResult:
    """:func:`walk_root`, with the live files' keys made."""
    walk = walk_root(root, sharded=sharded, remove_temps=remove_temps, walker=walker,
                     walk_threads=walk_threads)
    inv = walk.inventory
    files = index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names, walk.live,
                             inv.size[walk.live])
    unparsable, migrated = walk.unparsable_names, 0
    for row in walk.odd.tolist():
        path = Path(inv.file(row).fspath)
        key, moved = _odd_key(root, path, sharded=sharded, owner=remove_temps)
        if key is None:
            unparsable += 1
        elif moved is not False:
            files.pop(key, None)  # one file per key: the last seen wins, as for the others
            files[key] = int(inv.size[row])
            migrated += moved is True
    if migrated:
        logger.warning("kvpersist L2: %d file(s) of %s had an earlier version's ambiguous "
                       "names; renamed to this version's (their keys read from their headers)",
                       migrated, root)
    return ScanResult(files, walk.temp_files, walk.temp_removed, unparsable, migrated)


def _odd_key(root: Path, path: Path, *, sharded: bool, owner: bool
             ) -> tuple[KeyFields | None, bool | None]:
    """(key, moved) of a live file whose key is not all in its name: moved is None when the
    name is this version's, True when the owner renamed it to this version's name, False when
    it stays where it is unindexed (a reader's scan of an earlier version's name, or a file
    superseded by one already under the right name).  (None, None): not a cache file after all
    (an unreadable header, a header that does not name the file)."""
    try:
        named: KeyFields | None = parse_name(path.name)
    except FormatError:
        named = None
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
            key = parse_header(fh.read(HEADER_SIZE)).key
    except (OSError, FormatError):
        return named, None  # indexed by its name, if it has one: its first read quarantines it
    if format_name(key) == path.name:
        return key, None  # an escaped or hashed part, spelled out by the header
    if legacy_name(key) != path.name:
        return named, None  # the header names another file: as above
    if not owner:
        return key, False
    target = root.joinpath(*shard_path_parts(key, sharded))
    if os.path.lexists(target):
        quarantine_file(root, path, "superseded")
        return key, False
    os.rename(path, target)
    return key, True
