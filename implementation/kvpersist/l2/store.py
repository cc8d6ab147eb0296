"""The verified file store behind the kvpersist L2 adapter: a small facade over the layout, the
file operations and the index; the scan that fills the index at start is
:class:`kvpersist.l2.scanner.Scanner` (no LMCache dependency).

Invariants
----------
* **Never wrong bytes**: :meth:`KvFileStore.read_into` returns True only after
  :func:`~kvpersist.l2.files.read_verified` accepted the file.  Any failure is a miss; a file
  that fails its checks is moved to ``quarantine/`` (or removed once ``quarantine_max_files``
  or ``quarantine_max_bytes`` are kept) and counted, so the next store of that key writes a
  good file (repair).  The quarantine's bytes count against the cap: a store is refused when
  the index, the reservations and the quarantine together would pass it.
* **Faults never shift the accounting**: only "the file is absent" (ENOENT) removes a key, and
  only if the file is still absent under the index's lock (a store may have re-published it).
  Any other error (EMFILE, ENFILE, EACCES, ELOOP, EIO, ...) is a miss, counted in
  ``read_errors``, that leaves the index and the disk as they were; a file whose payload the
  device fails to read (EIO and kin) ``READ_ERRORS_TO_QUARANTINE`` times in a row is quarantined
  ("read-error"), so a persistent media error does not answer "exists" to every store
  forever.  Quarantine acts on the inode that was read: a file replaced meanwhile (a new store)
  is left alone; a bad file that cannot be moved or removed stays indexed (counted), never
  orphaned.
* **Atomic publish**: readers see no file or a complete one; a failed store leaves no temp file.
  Leftovers of a killed process are removed by the start-up scan, which runs only while this
  store holds the root's lock.
* **Exact accounting**: the index holds exactly the files published or found by the scan, and
  its byte count is the sum of their on-disk sizes (header included); the cap holds as stated
  in :mod:`kvpersist.l2.index`.  While the start-up scan runs, stores are refused (counted as
  ``rejected_scanning``) and lookups are answered from the disk.
* **The cap holds when the scan fails**: a scan that raises leaves the index incomplete, so
  stores stay refused (files already on disk are never outside the count), ``scan_error`` says
  why and the adapter reports itself unhealthy; the background scan is tried again
  (:mod:`kvpersist.l2.scanner`) until one succeeds, which clears the error.  A scan's entries
  are added only once it walked the whole tree, and adding is idempotent, so a retry never
  counts a file twice.
* **One writer per root** (:mod:`kvpersist.l2.lock`).
* **Shared tree** (``shared_tree``): this store's root is one node's part of a tree several
  nodes mount; keys its index lacks are looked up read-only in the other parts
  (:mod:`kvpersist.l2.shared_tree`).  The index, the byte count, eviction and quarantine cover
  this node's part only, so each node's cap holds for the files it wrote; a key another node
  holds is never stored again here ('exists').
* **A clean close leaves an index snapshot** (:mod:`kvpersist.l2.snapshot`), and the next open
  adopts it instead of walking the disk when the tree is provably unchanged; any doubt walks
  the disk.  Never on a shared tree, whose directory times a distributed file system keeps.
* :meth:`check` finds nothing wrong whenever no store, load or delete is in flight; every store
  test ends on it (python-diskcache's ``Cache.check()`` is the model).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.admin import WALKERS
from .census import QuarantineCensus
from .direct_write import DirectWriteRefused
from .files import (
    DISK_FULL,
    publish,
    quarantine_file,
    quarantined_origin,
    read_verified,
    verify_file,
)
from .format import HEADER_SIZE
from .index import KeyIndex, KeysCallback, Reservation
from .inventory import InventoryError
from .layout import (
    QUARANTINE_DIR,
    STATE_DIR,
    FormatError,
    KeyFields,
    Row,
    parse_name,
    row_of,
    shard_path_parts,
)
from .lease import Lease, LeaseExpired
from .lock import RootLockedError, take_root_lock
from .scan import scan_root
from .scanner import Scanner
from .shared_tree import SharedTree
from .snapshot import remove_leftovers
from .stats import StoreStats

__all__ = ["KvFileStore", "RootLockedError", "StoreStats"]


@dataclass(frozen=True)
class _FileRead:
    """The outcome of :meth:`KvFileStore._read_file`: the file was not there (``absent``), or
    it failed (``error``: a :class:`FormatError` is a failed check, an ``OSError`` a failed
    open or read), or it was verified (``verify_seconds``).  ``inode`` (device, inode) is the
    file that was opened, when one was."""

    absent: bool = False
    error: FormatError | OSError | None = None
    verify_seconds: float = 0.0
    inode: tuple[int, int] | None = None


#: Reads of one key whose payload the device failed to read (:data:`MEDIA_ERRORS`), in a row
#: within one process's life and one file (a restart, a deletion or a new store starts the count
#: again), before its file is quarantined.  The process's own limits (EMFILE, ENFILE, ENOMEM) and a
#: failed open are never the file's fault and never quarantine it.
READ_ERRORS_TO_QUARANTINE = 3
MEDIA_ERRORS = frozenset({errno.EIO, errno.ENODATA, errno.EUCLEAN, errno.EBADMSG})
#: Keys whose read failures are remembered (the oldest forgotten first).
_READ_ERROR_MEMORY = 4096

logger = logging.getLogger("kvpersist.l2")
#: Failures that depend on what the reader expected (the payload length LMCache asked for), so a
#: quarantined file of that kind may still pass its own checks.
_READER_DEPENDENT = ("length-mismatch", "read-error")
_REFUSAL_COUNTER = {Reservation.EXISTS: "store_exists",
                    Reservation.REJECTED_SCANNING: "rejected_scanning",
                    Reservation.REJECTED_CAPACITY: "rejected_capacity"}


class KvFileStore:
    """Files under ``root``, one per key, verified on every read (see module invariants)."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        *,
        sharded: bool = False,
        fsync: bool = False,
        quarantine_max_files: int = 1024,
        quarantine_max_bytes: int | None = None,
        on_added: KeysCallback | None = None,
        on_removed: KeysCallback | None = None,
        shared_tree: str | Path | None = None,
        shared_negative_ttl_s: float = 2.0,
        walker: str = "auto",
        walk_threads: int = 0,
        direct_io: bool = False,
        scan_snapshot: bool = True,
    ) -> None:
        self.root = Path(root)
        self.sharded = sharded
        self.fsync = fsync
        self.quarantine_max_files = quarantine_max_files
        #: default: one hundredth of the cap
        self.quarantine_max_bytes = (capacity_bytes // 100 if quarantine_max_bytes is None
                                     else quarantine_max_bytes)
        self._census = QuarantineCensus(self.root / QUARANTINE_DIR)
        self.index = KeyIndex(capacity_bytes, on_added=on_added, on_removed=on_removed)
        self.stats = StoreStats()
        self._lock_fd = -1
        self._read_errors: dict[KeyFields, int] = {}  # key -> failed reads in a row
        self._read_errors_lock = threading.Lock()
        if walker not in WALKERS:
            raise ValueError(f"unknown walker {walker!r}; one of {', '.join(WALKERS)}")
        if walk_threads < 0:
            raise ValueError(f"walk_threads must be 0 (one per CPU) or positive, got {walk_threads}")
        self.walker = walker
        self.walk_threads = walk_threads
        self.scanner = Scanner(self.root, self.index, self.stats, sharded=sharded, walker=walker,
                               walk_threads=walk_threads,
                               snapshot=scan_snapshot and shared_tree is None)
        # O_DIRECT reads and writes asked for and not (yet) refused by the file system
        self.direct_io = direct_io
        self.direct_writes = direct_io
        self.shared = None if shared_tree is None else SharedTree(
            Path(shared_tree), self.root, lambda key: shard_path_parts(key, self.sharded),
            negative_ttl_s=shared_negative_ttl_s)

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    # ------------------------------------------------------------------ lifecycle

    def open(self, *, background_scan: bool = True, remove_temps: bool = True) -> None:
        """Take the root lock and start the scan (names and sizes only).  ``remove_temps=False``
        leaves temp leftovers in place (an operator's :meth:`check` reports them instead)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / QUARANTINE_DIR).mkdir(mode=0o700, exist_ok=True)
        self._lock_fd = take_root_lock(self.root)
        if self.scanner.snapshot:
            (self.root / STATE_DIR).mkdir(mode=0o700, exist_ok=True)
            remove_leftovers(self.root)
        self._census.count_now()
        self.scanner.start(background=background_scan, remove_temps=remove_temps)

    def close(self) -> None:
        self.scanner.stop()
        if self._lock_fd >= 0:
            self.scanner.leave_snapshot()
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def abandon(self) -> int:
        """Give this root up without touching its device (lost, read-only or failing): the scan
        stops, the lock is released without a snapshot, and the index is drained, so the
        accounting drops every key it held.  Call it once no put, read or delete of this store
        is in flight.  Returns how many keys were dropped."""
        self.scanner.stop()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1
        return self.index.drain()

    def wait_scan(self, timeout: float | None = None) -> bool:
        return self.scanner.wait(timeout)

    @property
    def scan_done(self) -> bool:
        return self.index.complete

    @property
    def scan_error(self) -> str | None:
        """Why the last scan failed, while no scan has succeeded; else None."""
        return self.scanner.error

    # ------------------------------------------------------------------ paths

    def path_for(self, key: KeyFields) -> Path:
        return self.root.joinpath(*shard_path_parts(key, self.sharded))

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ lookup

    def contains(self, key: KeyFields) -> bool:
        """True if a file for ``key`` is known (or, during the scan, present on disk), here or,
        on a shared tree, in another node's part."""
        return self._contains_here(key) or (self.shared is not None
                                            and self.shared.find(key) is not None)

    def contains_many(self, keys: list[KeyFields]) -> list[bool]:
        """:meth:`contains` for a request's keys in order, except that the other nodes' parts
        are asked only up to the first key none of them has, *per row*: a request's hits are
        used as a prefix (LMCache's default fetching policy), so probing past a gap would cost
        N-1 ``stat`` calls per key for nothing (a new 500-chunk conversation on 64 nodes:
        31,500).  A row is every key field but the chunk hash (:func:`row_of`): at TP or PP
        above 1, or with several object groups, LMCache flattens one prefix per rank into one
        list, and a gap in rank 0's row says nothing about rank 1's.  Keys of this node's own
        part are reported whatever their position."""
        found: list[bool] = []
        gap_rows: set[Row] = set()
        for key in keys:
            if self._contains_here(key):
                found.append(True)
            elif self.shared is not None and row_of(key) not in gap_rows:
                hit = self.shared.find(key) is not None
                if not hit:
                    gap_rows.add(row_of(key))
                found.append(hit)
            else:
                found.append(False)
        return found

    def _contains_here(self, key: KeyFields) -> bool:
        if key in self.index:
            return True
        if self.index.complete:
            return False
        try:
            st = os.stat(self.path_for(key), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        self.index.add([(key, st.st_size)])
        return True

    # ------------------------------------------------------------------ store

    def put(self, key: KeyFields, payload: Any, layout: dict[str, Any] | None = None,
            lease: Lease | None = None) -> str:
        """Publish ``payload`` for ``key``.  Returns 'stored', 'exists' or a rejection tag.
        ``lease``: the payload may be read only while it holds; a file whose payload was not
        read in full before it ended is not published ('lease-expired', :mod:`.lease`)."""
        if lease is not None and lease.expired():
            self.stats.add(store_lease_expired=1)
            return "lease-expired"
        data = memoryview(payload).cast("B")
        size = HEADER_SIZE + data.nbytes
        if key not in self.index and self.shared is not None and self.shared.find(key):
            self.stats.add(store_exists_elsewhere=1)  # one copy in the tree is enough
            return "exists"
        granted = self.index.reserve(key, size, outside=self._census.get()[1])
        if granted is not Reservation.GRANTED:
            self.stats.add(**{_REFUSAL_COUNTER[granted]: 1})
            return str(granted.value)
        try:
            outcome = self._write(key, data, layout, lease)
        except BaseException:
            self.index.release(size)
            raise
        if outcome == "stored":
            self._forget_read_errors(key)  # a new file: its media errors are counted afresh
            self.index.commit(key, size)
            self.stats.add(stores=1, stored_bytes=size)
        else:
            self.index.release(size)
        return outcome

    def _write(self, key: KeyFields, data: memoryview, layout: dict[str, Any] | None,
               lease: Lease | None) -> str:
        final = self.path_for(key)
        check = None if lease is None else lease.check
        try:
            if self.sharded:
                final.parent.mkdir(parents=True, exist_ok=True)
            try:
                publish(final, key, data, layout, fsync=self.fsync, direct=self.direct_writes,
                        before_rename=check)
            except DirectWriteRefused as exc:
                self._refuse_direct_writes(exc)
                publish(final, key, data, layout, fsync=self.fsync, before_rename=check)
            return "stored"
        except LeaseExpired as exc:
            self.stats.add(store_lease_expired=1)
            logger.warning("kvpersist L2: store of %s given up, not published: %s", final.name,
                           exc)
            return "lease-expired"
        except OSError as exc:
            if exc.errno in DISK_FULL:
                self.stats.add(rejected_disk_full=1)
                logger.warning("kvpersist L2: disk full, store of %s rejected", final.name)
                return "rejected-disk-full"
            self.stats.add(store_errors=1)
            logger.warning("kvpersist L2: store of %s failed: %s", final.name, exc)
            return "error"

    # ------------------------------------------------------------------ load

    def read_into(self, key: KeyFields, buf: Any, lease: Lease | None = None) -> bool:
        """Fill ``buf`` with the verified payload of ``key``; False (a miss) otherwise.  A file
        of this node's that fails its check is quarantined (repair: the next store rewrites
        it).  ``lease``: ``buf`` may be written only while it holds; a read that would start
        after it ended is a miss (:mod:`.lease`)."""
        if lease is not None and lease.expired():
            self.stats.add(loads=1, load_misses=1, load_lease_expired=1)
            return False
        if (self.shared is not None and self.index.complete and key not in self.index):
            return self._read_elsewhere(key, buf)
        began = time.perf_counter()
        path = self.path_for(key)
        out = memoryview(buf).cast("B")
        read = self._read_file(path, key, out)
        if read.absent:
            # vanished (cleanup, an eviction race): an ordinary miss, unless a store has just
            # published it again
            self.index.remove_if_gone(key, lambda: os.path.lexists(path))
            if self.shared is not None:
                return self._read_elsewhere(key, buf)
            self.stats.add(loads=1, load_misses=1)
            return False
        if isinstance(read.error, FormatError):
            self.stats.add(loads=1)
            self._forget_read_errors(key)
            self._quarantine(path, key, read.error.reason, str(read.error), read.inode)
            return False
        if read.error is not None:
            self._read_failed(path, key, read)
            return False
        self._forget_read_errors(key)
        self.index.touch(key)
        self.stats.add(loads=1, load_hits=1, loaded_bytes=out.nbytes,
                       verify_seconds=read.verify_seconds,
                       load_seconds=time.perf_counter() - began)
        return True

    def _read_elsewhere(self, key: KeyFields, buf: Any) -> bool:
        """Read ``key`` from another node's part: verified like any read; any failure is a miss
        and leaves that file alone (its owner may be replacing or evicting it)."""
        assert self.shared is not None
        began = time.perf_counter()
        path = self.shared.find(key)
        if path is None:
            self.stats.add(loads=1, load_misses=1)
            return False
        out = memoryview(buf).cast("B")
        read = self._read_file(path, key, out)
        if read.absent or read.error is not None:
            self.shared.forget(key)
            if read.error is not None:
                logger.warning("kvpersist L2: %s from another node is a miss: %s", path.name,
                               read.error)
            self.stats.add(loads=1, load_misses=1, foreign_failures=int(not read.absent))
            return False
        self.stats.add(loads=1, load_hits=1, loaded_bytes=out.nbytes, foreign_hits=1,
                       verify_seconds=read.verify_seconds,
                       load_seconds=time.perf_counter() - began)
        return True

    def _read_file(self, path: Path, key: KeyFields, out: memoryview) -> _FileRead:
        """The one verified read of a file, a node's own or another's: ``out`` holds the
        payload only when the outcome has no error and the file was there.  A hit also marks
        the file's last access (LRU order that survives restarts, the owner's included)."""
        direct = self.direct_io
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return _FileRead(absent=True)
            if not (direct and exc.errno == errno.EINVAL):
                return _FileRead(error=exc)  # EMFILE, EACCES, ELOOP, EIO...: not "gone"
            self._refuse_direct(path, exc)
            return self._read_file(path, key, out)
        inode: tuple[int, int] | None = None
        try:
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            verify_seconds = read_verified(fd, key, out, self.stats.read_progress, direct=direct,
                                           file_size=st.st_size)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                return _FileRead(error=exc, inode=inode)
            self._refuse_direct(path, exc)  # alignment the device will not take: buffered
            os.close(fd)
            fd = -1
            return self._read_file(path, key, out)
        except FormatError as exc:
            return _FileRead(error=exc, inode=inode)
        finally:
            if fd >= 0:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(path)
        return _FileRead(verify_seconds=verify_seconds, inode=inode)

    def _read_failed(self, path: Path, key: KeyFields, read: _FileRead) -> None:
        """A read that failed for another reason than absence or the file's checks: a miss,
        counted; the file is quarantined once such failures of ``key`` persist."""
        self.stats.add(loads=1, load_misses=1, read_errors=1)
        media = (read.inode is not None and isinstance(read.error, OSError)
                 and read.error.errno in MEDIA_ERRORS)
        if not media:
            logger.warning("kvpersist L2: read of %s failed: %s; a miss", path.name, read.error)
            return
        with self._read_errors_lock:
            failures = self._read_errors.pop(key, 0) + 1
            if failures < READ_ERRORS_TO_QUARANTINE:
                self._read_errors[key] = failures
                while len(self._read_errors) > _READ_ERROR_MEMORY:
                    del self._read_errors[next(iter(self._read_errors))]
        logger.warning("kvpersist L2: read of %s failed (%d in a row): %s; a miss", path.name,
                       failures, read.error)
        if failures >= READ_ERRORS_TO_QUARANTINE:
            self._quarantine(path, key, "read-error", str(read.error), read.inode,
                             count_miss=False)

    def _forget_read_errors(self, key: KeyFields) -> None:
        if self._read_errors:
            with self._read_errors_lock:
                self._read_errors.pop(key, None)

    def _refuse_direct(self, path: Path, exc: OSError) -> None:
        if self.direct_io:
            self.direct_io = False
            logger.warning("kvpersist L2: O_DIRECT reads refused under %s (%s: %s); reading "
                           "through the page cache from now on", self.root, path.name,
                           exc.strerror)

    def _refuse_direct_writes(self, exc: OSError) -> None:
        if self.direct_writes:
            self.direct_writes = False
            logger.warning("kvpersist L2: O_DIRECT writes refused under %s (%s); writing "
                           "through the page cache from now on", self.root, exc.strerror)

    def quarantine_key(self, key: KeyFields, reason: str, detail: str) -> None:
        """Quarantine ``key``'s file, which passed its own checks but whose payload a layer above
        refused (an encrypted chunk whose tag fails under its key): it is not read again."""
        self._quarantine(self.path_for(key), key, reason, detail)

    def _quarantine(self, path: Path, key: KeyFields, reason: str, detail: str,
                    inode: tuple[int, int] | None = None, *, count_miss: bool = True) -> None:
        """Move ``key``'s bad file out of the data (see the module invariants): only the file
        whose (device, inode) is ``inode`` when given."""
        self.stats.failed(reason, count_miss=count_miss)
        if inode is not None and _inode_at(path) != inode:
            logger.warning("kvpersist L2: %s failed (%s; %s) but was replaced since it was "
                           "read; the new file is left alone", path.name, reason, detail)
            return
        try:
            count = sum(1 for _ in os.scandir(self.root / QUARANTINE_DIR))
        except OSError:
            count = self.quarantine_max_files
        try:
            size = os.lstat(path).st_size
        except OSError:
            size = 0
        room = (count < self.quarantine_max_files
                and self._census.get()[1] + size <= self.quarantine_max_bytes)
        removed = True
        try:
            if room:
                moved = quarantine_file(self.root, path, reason)
                if inode is not None and _inode_at(moved) != inode:
                    self._put_back(moved, path)  # replaced between the check and the move
                    return
                with contextlib.suppress(OSError):
                    self._census.added(moved.stat().st_size)
                action = f"moved to {moved}"
            else:
                os.unlink(path)
                action = "removed (quarantine full)"
        except FileNotFoundError:
            action = "already gone"
        except OSError as exc:
            try:
                os.unlink(path)
                action = f"removed (it could not be moved: {exc.strerror})"
            except OSError as again:
                removed = False  # still on disk, so still counted
                action = (f"left in place and still counted (move: {exc.strerror}; remove: "
                          f"{again.strerror})")
        if removed and inode is not None:  # unless a new store published the key meanwhile
            self.index.remove_if_gone(key, lambda: _inode_at(path) not in (None, inode))
        elif removed:
            self.index.remove(key)
        logger.warning("kvpersist L2: verification failed for %s (%s); a miss, file %s",
                       path.name, detail, action)

    def _put_back(self, moved: Path, path: Path) -> None:
        """A file published at ``path`` after the bad one was read went to quarantine by a
        race: it goes back, unless ``path`` is taken again (then it stays in quarantine, where
        :meth:`check` reports it as verifying)."""
        try:
            os.link(moved, path)
            os.unlink(moved)
            logger.warning("kvpersist L2: %s was replaced while it was quarantined; the new "
                           "file is left in place", path.name)
        except OSError as exc:
            logger.error("kvpersist L2: %s was replaced while it was quarantined and could not "
                         "be put back (%s); it stays in %s", path.name, exc.strerror, moved)

    # ------------------------------------------------------------------ delete / list

    def delete(self, key: KeyFields) -> int | None:
        """Remove ``key``'s file; returns its accounted size, or None if it was not indexed or
        could not be removed (an unlink that fails for another reason than absence leaves the
        file and its count as they were, counted in ``delete_errors``)."""
        path = self.path_for(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.stats.add(delete_errors=1)
            logger.warning("kvpersist L2: %s could not be removed (%s); it stays counted",
                           path.name, exc.strerror)
            return None
        self._forget_read_errors(key)
        size = self.index.remove(key)
        if size is not None:
            self.stats.add(evicted=1)
        return size

    def list_keys(self, model_name: str | None, offset: int, limit: int
                  ) -> tuple[list[tuple[KeyFields, int]], int | None]:
        """A page of (key, size) sorted by file name; returns the next offset or None."""
        return self.index.page(model_name, offset, limit)

    # ------------------------------------------------------------------ status / check

    def status(self) -> dict[str, Any]:
        files, used, reserved = self.index.totals()
        quarantine_files, quarantine_bytes = self._census.get()  # never waits on the disk
        return {
            "root": str(self.root),
            "sharded": self.sharded,
            "files": files,
            "used_bytes": used,
            "reserved_bytes": reserved,
            "capacity_bytes": self.capacity_bytes,
            "usage_fraction": used / self.capacity_bytes,
            **self.scanner.status(),
            "direct_io": self.direct_io,
            "scanned_files": self.scanner.files,
            **self.stats.as_dict(),
            "quarantine_files": quarantine_files,
            "quarantine_bytes": quarantine_bytes,
            **({} if self.shared is None else {"shared_tree": self.shared.status()}),
        }

    def check(self, *, deep: bool = False) -> list[str]:
        """Consistency problems of the quiescent store; an empty list means none.

        Checked: the scan finished without error; the index equals the published files on
        disk (same keys, each size equal to the file's size); the byte count equals the sum of
        those sizes and no reservation is left; no temp file remains in a data directory;
        quarantine holds only files that fail verification under their original name (or
        failed the reader's expected length).
        ``deep`` also verifies every indexed file's header and checksum.
        """
        problems: list[str] = []
        if self.scanner.error is not None:
            return [f"the start-up scan failed: {self.scanner.error}"]
        if not self.index.complete:
            return ["the start-up scan has not finished"]
        try:
            on_disk = scan_root(self.root, sharded=self.sharded, remove_temps=False)
        except InventoryError as exc:
            return [f"the tree cannot be walked: {exc}"]
        disk = on_disk.files
        indexed = self.index.snapshot()
        files, used, reserved = self.index.totals()
        for key in sorted(indexed.keys() - disk.keys(), key=repr):
            problems.append(f"indexed but not on disk: {self.path_for(key)}")
        for key in sorted(disk.keys() - indexed.keys(), key=repr):
            problems.append(f"on disk but not indexed: {self.path_for(key)}")
        for key in sorted(indexed.keys() & disk.keys(), key=repr):
            if indexed[key] != disk[key]:
                problems.append(f"size of {self.path_for(key)}: indexed {indexed[key]}, "
                                f"on disk {disk[key]}")
        if used != sum(indexed.values()) or files != len(indexed):
            problems.append(f"byte count {used} != sum of indexed sizes {sum(indexed.values())}")
        if reserved != 0:
            problems.append(f"{reserved} bytes still reserved with no store in flight")
        problems += [f"temp file left: {path}" for path in on_disk.temp_files]
        problems += self._check_quarantine()
        if deep:
            for key in sorted(indexed, key=repr):
                reason, _ = verify_file(self.path_for(key), key)
                if reason is not None:
                    problems.append(f"{self.path_for(key)} fails verification: {reason}")
        return problems

    def _check_quarantine(self) -> Iterator[str]:
        qdir = self.root / QUARANTINE_DIR
        try:
            entries = sorted(os.scandir(qdir), key=lambda e: e.name)
        except FileNotFoundError:
            return
        for entry in entries:
            origin = quarantined_origin(entry.name)
            if origin is None or not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                yield f"not a quarantined cache file: {entry.path}"
                continue
            name, why = origin
            if why in _READER_DEPENDENT:
                continue  # the file failed the reader's expectation, not its own checks
            try:
                key = parse_name(name)
            except FormatError:
                continue  # its name was the failure
            reason, _ = verify_file(Path(entry.path), key)
            if reason is None:
                yield f"quarantined but verifies: {entry.path}"


def _inode_at(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path`` (not followed), or None if there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
