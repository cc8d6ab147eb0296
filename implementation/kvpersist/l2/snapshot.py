"""The index snapshot: the start-up scan's result, taken when the store closes cleanly, so that
the next start need not ``stat`` every file.  The scan bounds how soon stores resume after a
restart; with a snapshot a clean restart reads one file instead of walking a million.

Invariants
----------
* A snapshot is a walk of the tree (:func:`kvpersist.l2.scan.walk_root`) made by the store that
  holds the root's lock, as it closes: what a start-up scan would find, not what the index
  believes (a file an operator renamed while the server ran is seen as it is on disk).  None is
  written while a temp file (a store in flight) is in a data directory.
* Used at most once: the opening store removes it (and syncs its directory) before it adopts
  anything, so after a crash there is none and the next start walks the disk.
* Adopted only if the tree is provably unchanged since the walk: every data directory, and when
  sharded every shard directory above one, still has the inode and mtime stamped *before* the
  walk.  A file created, removed or renamed in a directory changes that directory's mtime;
  published files are never modified in place, so their sizes cannot change unseen (a byte
  changed in place is caught by the check on every read, as always).
* No racy stamp: a directory changed in the same tick of the file system's clock as its stamp
  would keep its mtime, so every stamp must be older than a time the file system gave just
  before the stamps were taken (git's rule for racily clean index entries); otherwise they are
  taken again a little later, and if they are still racy no snapshot is written.
* Its bytes are checked (xxh3-128 over everything before the trailing digest); a snapshot that
  fails any check is ignored with a log line saying why, and the disk is walked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from ..atomic import TMP_MARK
from .layout import STATE_DIR
from .scan import TreeWalk

logger = logging.getLogger("kvpersist.l2")

SNAPSHOT_NAME = "index-snapshot"
MAGIC = b"KVPSNAP1"
VERSION = 1
_DIGEST = 16  # xxh3-128, trailing
_RACY_RETRY_S = 0.05

#: (directory relative to the root, '' for the root; inode; mtime in ns).
Stamp = tuple[str, int, int]


def snapshot_path(root: Path) -> Path:
    return root / STATE_DIR / SNAPSHOT_NAME


def stamp_tree(root: Path, sharded: bool) -> list[Stamp]:
    """The stamps of every directory whose entries a scan would read for data: the root and,
    sharded, every two-character directory under it and under those (as
    :func:`kvpersist.l2.layout.is_data_dir` counts them, plus the level between)."""
    stamps = [_stamp(root, "")]
    if sharded:
        for outer in _two_char_dirs(root):
            stamps.append(_stamp(root, outer))
            stamps += [_stamp(root, f"{outer}/{inner}")
                       for inner in _two_char_dirs(root / outer)]
    return stamps


def _stamp(root: Path, rel: str) -> Stamp:
    st = os.lstat(root / rel if rel else root)
    return rel, st.st_ino, st.st_mtime_ns


def _two_char_dirs(directory: Path) -> list[str]:
    with os.scandir(directory) as entries:
        return sorted(e.name for e in entries
                      if len(e.name) == 2 and e.is_dir(follow_symlinks=False))


def unchanged(root: Path, stamps: list[Stamp]) -> str | None:
    """None if every stamped directory still has its stamp; else what changed."""
    for rel, ino, mtime_ns in stamps:
        try:
            now = _stamp(root, rel)
        except OSError as exc:
            return f"{rel or 'the root'}: {exc.strerror}"
        if now != (rel, ino, mtime_ns):
            return f"{rel or 'the root'} changed since the snapshot"
    return None


@dataclass
class Snapshot:
    """An adopted snapshot: a walk's name columns (entry ``i`` is
    ``names[name_end[i-1]:name_end[i]]``, of model ``model_names[model_idx[i]]`` when live), the
    live ``rows`` least recently used first, and their accounted ``sizes``."""

    names: bytes | memoryview
    name_end: npt.NDArray[np.int64]
    model_idx: npt.NDArray[np.int32]
    rows: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    model_names: list[str]
    stamps: list[Stamp]
    used_bytes: int
    sharded: bool
    unparsable_names: int

    def __len__(self) -> int:
        return int(self.rows.size)


#: Walks the tree (called after the stamps are taken).
Walk = Callable[[], TreeWalk]


def write_snapshot(root: Path, sharded: bool, walk: Walk) -> int | None:
    """Stamp the tree, walk it and write the snapshot atomically; the number of files it holds,
    or None (nothing written) if the stamps stayed racy or a store was in flight.  The caller
    holds the root's lock."""
    state = root / STATE_DIR
    state.mkdir(mode=0o700, exist_ok=True)
    tmp = state / f"{SNAPSHOT_NAME}{TMP_MARK}{os.getpid()}"
    written = False
    try:
        with open(tmp, "wb", opener=_private_opener) as out:
            stamps = _unracy_stamps(root, sharded, out.fileno())
            if stamps is None:
                _no_snapshot(root, "directories changed while it was taken")
                return None
            walked = walk()
            if walked.temp_files:
                _no_snapshot(root, "a store was in flight")
                return None
            if walked.odd.size:  # the snapshot's columns hold names, not header keys
                _no_snapshot(root, f"{walked.odd.size} file name(s) keep their keys in their "
                             "headers")
                return None
            for part in _encode(walked, stamps, sharded):
                out.write(part)
        os.rename(tmp, state / SNAPSHOT_NAME)
        written = True
        return int(walked.live.size)
    finally:
        if not written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _no_snapshot(root: Path, why: str) -> None:
    logger.info("kvpersist L2: no index snapshot of %s (%s); the next start walks the disk",
                root, why)


def remove_leftovers(root: Path) -> None:
    """Remove what a snapshot writer killed mid-write left in the state directory."""
    with contextlib.suppress(FileNotFoundError), os.scandir(root / STATE_DIR) as entries:
        for entry in entries:
            if entry.name.startswith(SNAPSHOT_NAME + TMP_MARK):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _unracy_stamps(root: Path, sharded: bool, clock_fd: int) -> list[Stamp] | None:
    """The tree's stamps, each older than the file system's clock just before they were taken
    (read as the mtime ``clock_fd`` gets when touched); None if they stay racy."""
    for _ in range(2):
        os.utime(clock_fd)
        fs_now = os.fstat(clock_fd).st_mtime_ns
        stamps = stamp_tree(root, sharded)
        if all(mtime_ns < fs_now for _, _, mtime_ns in stamps):
            return stamps
        time.sleep(_RACY_RETRY_S)
    return None


def _encode(walked: TreeWalk, stamps: list[Stamp], sharded: bool) -> list[bytes]:
    """The walk's name columns whole (no Python object per file), the live rows least recently
    used first, and their sizes."""
    inv = walked.inventory
    rows = np.ascontiguousarray(walked.live, np.int64)
    sizes = np.ascontiguousarray(inv.size[rows], np.int64)
    header = json.dumps({
        "version": VERSION, "sharded": sharded, "stamps": stamps,
        "names_bytes": len(inv.names), "entries": len(inv), "files": int(rows.size),
        "used_bytes": int(sizes.sum()), "model_names": list(inv.model_names),
        "unparsable_names": walked.unparsable_names,
    }).encode()
    parts = [MAGIC, struct.pack("<Q", len(header)), header, bytes(inv.names),
             np.ascontiguousarray(inv.name_end, np.int64).tobytes(),
             np.ascontiguousarray(inv.model_idx, np.int32).tobytes(), rows.tobytes(),
             sizes.tobytes()]
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest()]


def take_snapshot(root: Path) -> bytes | mmap.mmap | None:
    """Map and remove the root's snapshot (its raw bytes, or None if there is none).  The
    removal is synced, so it is never adopted twice.  The bytes are mapped, not copied (a
    snapshot is ~150 MB per million files); the mapping outlives the unlinked file and goes
    away with the last array that views it."""
    path = snapshot_path(root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        raw: bytes | mmap.mmap = (mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ)
                                  if size else b"")
    finally:
        os.close(fd)
    os.unlink(path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return raw


def decode(raw: bytes | mmap.mmap) -> Snapshot:
    """Parse and check a snapshot's bytes; ValueError saying what is wrong."""
    if len(raw) < len(MAGIC) + 8 + _DIGEST or raw[:len(MAGIC)] != MAGIC:
        raise ValueError("not an index snapshot")
    view = memoryview(raw)  # slices of a view copy nothing (a snapshot is ~150 MB per 1M files)
    if xxhash.xxh3_128_digest(view[:-_DIGEST]) != raw[-_DIGEST:]:
        raise ValueError("checksum mismatch")
    (hlen,) = struct.unpack_from("<Q", raw, len(MAGIC))
    at = len(MAGIC) + 8
    header = json.loads(raw[at:at + hlen])
    if header.get("version") != VERSION:
        raise ValueError(f"snapshot version {header.get('version')!r}, not {VERSION}")
    at += hlen
    entries, files, nb = int(header["entries"]), int(header["files"]), int(header["names_bytes"])
    if at + nb + entries * (8 + 4) + files * (8 + 8) + _DIGEST != len(raw):
        raise ValueError("length does not match its header")
    names = view[at:at + nb]
    at += nb
    ends = np.frombuffer(raw, np.int64, entries, at)
    at += 8 * entries
    model_idx = np.frombuffer(raw, np.int32, entries, at)
    at += 4 * entries
    rows = np.frombuffer(raw, np.int64, files, at)
    at += 8 * files
    sizes = np.frombuffer(raw, np.int64, files, at)
    model_names = [str(m) for m in header["model_names"]]
    if entries and (int(ends[-1]) != nb or int(ends[0]) <= 0 or np.any(np.diff(ends) <= 0)):
        raise ValueError("inconsistent name columns")
    if files and (int(rows.min()) < 0 or int(rows.max()) >= entries
                  or int(model_idx[rows].min()) < 0
                  or int(model_idx[rows].max()) >= len(model_names)
                  or int(sizes.min()) <= 0):
        raise ValueError("inconsistent rows")
    if int(sizes.sum()) != int(header["used_bytes"]):
        raise ValueError("byte count does not match its sizes")
    stamps = [(str(rel), int(ino), int(mtime)) for rel, ino, mtime in header["stamps"]]
    return Snapshot(names, ends, model_idx, rows, sizes, model_names, stamps,
                    int(header["used_bytes"]), bool(header["sharded"]),
                    int(header["unparsable_names"]))
