"""The start-up scan's life: adopt the index snapshot or walk the tree, retry after a failure,
and leave a snapshot at a clean close.  The store (:mod:`kvpersist.l2.store`) keeps put, read,
delete and check; this object only fills its index.

Invariants
----------
* The index is filled in one step (:meth:`KeyIndex.adopt_scan`), only from a whole walk or a
  snapshot proven current, and marked complete only then; adding is idempotent, so a retry
  never counts a file twice.
* A scan that raises leaves the index incomplete (stores refused), records why (:attr:`error`)
  and, in the background, is tried again after ``SCAN_RETRY_S``, doubling up to
  ``SCAN_RETRY_MAX_S``, until one succeeds (which clears the error) or the store closes.
* A snapshot is used at most once (removed when read) and left only by a clean close of a store
  whose scan succeeded (:mod:`kvpersist.l2.snapshot`); never on a shared tree.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from .index import KeyIndex
from .inventory import InventoryError, index_of_columns
from .layout import KeyFields
from .scan import scan_root, walk_root
from .snapshot import decode, take_snapshot, unchanged, write_snapshot
from .stats import StoreStats

logger = logging.getLogger("kvpersist.l2")

#: The first wait before a failed background scan is tried again; it doubles up to the max.
SCAN_RETRY_S = 5.0
SCAN_RETRY_MAX_S = 60.0


class Scanner:
    """Fills ``index`` from ``root`` (see the module invariants)."""

    def __init__(self, root: Path, index: KeyIndex, stats: StoreStats, *, sharded: bool,
                 walker: str, walk_threads: int, snapshot: bool) -> None:
        self.root = root
        self.index = index
        self.stats = stats
        self.sharded = sharded
        self.walker = walker
        self.walk_threads = walk_threads
        #: Adopt and leave index snapshots (a clean restart reads one file, not the tree).
        self.snapshot = snapshot
        self.remove_temps = True
        self.error: str | None = None  # why the last scan failed, while none succeeded
        self.seconds: float | None = None
        self.files = 0
        self.failures = 0
        self.source: str | None = None  # "snapshot" or "disk", once a scan succeeded
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start(self, *, background: bool, remove_temps: bool) -> None:
        """Scan now (``background=False``) or in a thread that retries until done."""
        self.remove_temps = remove_temps
        if background:
            self._thread = threading.Thread(target=self._until_done, name="kvpersist-l2-scan",
                                            daemon=True)
            self._thread.start()
        else:
            self.scan_once()

    def stop(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the index became complete within ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.index.complete:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def status(self) -> dict[str, Any]:
        return {"scan_done": self.index.complete, "scan_seconds": self.seconds,
                "scan_source": self.source, "scan_error": self.error,
                "scan_failures": self.failures}

    def _until_done(self) -> None:
        wait = SCAN_RETRY_S
        while not self.scan_once() and not self._closing.wait(wait):
            wait = min(wait * 2, SCAN_RETRY_MAX_S)

    def scan_once(self) -> bool:
        """One scan; True once the index is complete.  A failure keeps it incomplete (stores
        refused) and records why."""
        began = time.monotonic()
        try:
            adopted = self._adopt_snapshot()
            if adopted is not None:
                files, unparsable = adopted
                self.stats.add(unparsable_names=unparsable)
                self.source = "snapshot"
            else:
                found = scan_root(self.root, sharded=self.sharded,
                                  remove_temps=self.remove_temps, walker=self.walker,
                                  walk_threads=self.walk_threads)
                self.stats.add(temp_removed=found.temp_removed,
                               unparsable_names=found.unparsable_names,
                               migrated_names=found.migrated_names)
                files = found.files
                self.source = "disk"
            self.files = len(files)
            self.index.adopt_scan(files)  # one step; lookups meanwhile stat the disk
        except Exception as exc:  # keep serving lookups; refuse stores; report the failure
            self.failures += 1
            self.error = f"{type(exc).__name__}: {exc}"
            self.seconds = time.monotonic() - began
            logger.exception("kvpersist L2 scan of %s failed (attempt %d); stores are refused "
                             "until a scan succeeds", self.root, self.failures)
            return False
        self.seconds = time.monotonic() - began
        if self.error is not None:
            logger.warning("kvpersist L2 scan of %s succeeded after %d failed attempt(s) "
                           "(last: %s); stores resume", self.root, self.failures, self.error)
        self.error = None
        self.index.mark_complete()
        logger.info("kvpersist L2 scan of %s (from the %s): %d files, %d bytes, %.2fs",
                    self.root, self.source, len(self.index), self.index.used_bytes, self.seconds)
        return True

    def _adopt_snapshot(self) -> tuple[dict[KeyFields, int], int] | None:
        """The files (key → size) and unparsable-name count of the snapshot a clean close left,
        if the tree is provably unchanged since (see :mod:`kvpersist.l2.snapshot`); else None,
        and the disk is walked.  The snapshot is removed either way: it is used at most once."""
        if not self.snapshot:
            return None
        try:
            raw = take_snapshot(self.root)
            if raw is None:
                return None
            snap = decode(raw)
            why = (f"it was written with sharded={snap.sharded}" if snap.sharded != self.sharded
                   else unchanged(self.root, snap.stamps))
            if why is None:
                files = index_of_columns(snap.names, snap.name_end, snap.model_idx,
                                         snap.model_names, snap.rows, snap.sizes)
                why = unchanged(self.root, snap.stamps)  # nothing changed meanwhile
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            logger.info("kvpersist L2: the index snapshot of %s is not used (%s); walking the "
                        "disk", self.root, why)
            return None
        return files, snap.unparsable_names

    def leave_snapshot(self) -> None:
        """Walk the tree and leave it as the index snapshot for the next start (while the
        root's lock is held; see :mod:`kvpersist.l2.snapshot`)."""
        if not self.snapshot or not self.index.complete or self.error is not None:
            return
        began = time.monotonic()
        try:
            files = write_snapshot(self.root, self.sharded, lambda: walk_root(
                self.root, sharded=self.sharded, remove_temps=False, walker=self.walker,
                walk_threads=self.walk_threads))
        except (OSError, InventoryError) as exc:
            logger.warning("kvpersist L2: no index snapshot of %s (%s); the next start walks "
                           "the disk", self.root, exc)
            return
        if files is not None:
            logger.info("kvpersist L2: index snapshot of %s written (%d files, %.2fs)",
                        self.root, files, time.monotonic() - began)
