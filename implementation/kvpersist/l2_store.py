"""The verified file store behind the kvpersist L2 adapter (no LMCache dependency).

Invariants
----------
* **Never wrong bytes**: :meth:`KvFileStore.read_into` returns True only after the header
  (magic, version, header digest, exact key, payload length), the file size and the payload
  digest all check out.  Any failure is a miss; the file is moved to ``quarantine/`` (or removed)
  and counted, so the next store of that key writes a good file (repair).
* **Atomic publish**: data is written to ``<name>.tmp.<random>`` in the final directory and
  renamed into place; readers see no file or a complete one.  Temp leftovers are removed by the
  start-up scan, which runs only while this store holds the root's lock.
* **Exact accounting**: ``used_bytes`` is the sum of the on-disk sizes (header included) of the
  files in the index, and the index holds exactly the files published or found by the scan.
  ``used_bytes + reserved_bytes <= capacity_bytes`` always holds: a store reserves its size
  first and is rejected if it does not fit.  While the start-up scan runs, the count is not yet
  complete, so stores are rejected (counted as ``rejected_scanning``); lookups are answered from
  the disk meanwhile.
* **One writer per root**: an exclusive ``flock`` on ``<root>/.kvpersist.lock`` is held for the
  store's lifetime; a second store on the same root fails to open with a message naming the
  holder's pid.
* Callbacks (``on_added``/``on_removed``) are called outside the internal lock, once per index
  change, with the same sizes that entered or left ``used_bytes``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .inventory import LIVE, TEMP, UNPARSABLE, build_inventory
from .l2_format import (
    HEADER_SIZE,
    QUARANTINE_DIR,
    SUFFIX,
    TMP_MARK,
    FormatError,
    KeyFields,
    build_header,
    check_header,
    format_name,
    parse_header,
    parse_name,
    payload_digest,
    payload_hasher,
    shard_dirs,
)

logger = logging.getLogger("kvpersist.l2")

LOCK_NAME = ".kvpersist.lock"
_VERIFY_SEGMENT = 1 << 20
KeysCallback = Callable[[list[KeyFields], list[int]], None]


class RootLockedError(RuntimeError):
    """Another process already serves this cache root."""


@dataclass
class StoreStats:
    """Counters since start; ``verify_failures`` is keyed by reason tag."""

    stores: int = 0
    stored_bytes: int = 0
    store_exists: int = 0
    rejected_capacity: int = 0
    rejected_scanning: int = 0
    rejected_disk_full: int = 0
    store_errors: int = 0
    loads: int = 0
    load_hits: int = 0
    load_misses: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    verify_seconds: float = 0.0
    quarantined: int = 0
    evicted: int = 0
    temp_removed: int = 0
    unparsable_names: int = 0
    verify_failures: Counter[str] = field(default_factory=Counter)


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
        on_added: KeysCallback | None = None,
        on_removed: KeysCallback | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.sharded = sharded
        self.fsync = fsync
        self.quarantine_max_files = quarantine_max_files
        self._on_added = on_added or (lambda keys, sizes: None)
        self._on_removed = on_removed or (lambda keys, sizes: None)
        self._lock = threading.Lock()
        self._index: dict[KeyFields, int] = {}
        self._used = 0
        self._reserved = 0
        self._scan_done = threading.Event()
        self._scan_error: str | None = None
        self._scan_seconds: float | None = None
        self._scanned_files = 0
        self._list_cache: tuple[int, list[KeyFields]] | None = None
        self._version = 0
        self.stats = StoreStats()
        self._lock_fd = -1
        self._scan_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def open(self, *, background_scan: bool = True) -> None:
        """Take the root lock and start the scan (names and sizes only)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / QUARANTINE_DIR).mkdir(mode=0o700, exist_ok=True)
        self._lock_fd = _take_root_lock(self.root / LOCK_NAME)
        if background_scan:
            self._scan_thread = threading.Thread(target=self._scan, name="kvpersist-l2-scan",
                                                 daemon=True)
            self._scan_thread.start()
        else:
            self._scan()

    def close(self) -> None:
        if self._scan_thread is not None:
            self._scan_thread.join(timeout=30)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def wait_scan(self, timeout: float | None = None) -> bool:
        return self._scan_done.wait(timeout)

    @property
    def scan_done(self) -> bool:
        return self._scan_done.is_set()

    # ------------------------------------------------------------------ paths

    def path_for(self, key: KeyFields) -> Path:
        name = format_name(key)
        if self.sharded:
            a, b = shard_dirs(key.chunk_hash)
            return self.root / a / b / name
        return self.root / name

    # ------------------------------------------------------------------ index

    def _index_add(self, items: Iterable[tuple[KeyFields, int]], *, release_reserved: int = 0
                   ) -> None:
        """Add entries; ``release_reserved`` bytes of reservation are released in the same
        critical section, so ``used + reserved`` never dips while a store turns into usage."""
        added_keys: list[KeyFields] = []
        added_sizes: list[int] = []
        with self._lock:
            self._reserved -= release_reserved
            for key, size in items:
                if key in self._index:
                    continue
                self._index[key] = size
                self._used += size
                added_keys.append(key)
                added_sizes.append(size)
            if added_keys:
                self._version += 1
        if added_keys:
            self._on_added(added_keys, added_sizes)

    def _index_remove(self, key: KeyFields) -> int | None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self._version += 1
        if size is not None:
            self._on_removed([key], [size])
        return size

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------------ scan

    def _scan(self) -> None:
        began = time.monotonic()
        try:
            keys, sizes = self._scan_files()
            batch = 4096
            for start in range(0, len(keys), batch):
                self._index_add(zip(keys[start:start + batch], sizes[start:start + batch],
                                    strict=True))
            self._scanned_files = len(keys)
        except Exception as exc:  # keep serving lookups; report the failure
            self._scan_error = f"{type(exc).__name__}: {exc}"
            logger.exception("kvpersist L2 scan of %s failed", self.root)
        finally:
            self._scan_seconds = time.monotonic() - began
            self._scan_done.set()
            logger.info("kvpersist L2 scan of %s: %d files, %d bytes, %.2fs",
                        self.root, len(self), self.used_bytes, self._scan_seconds)

    def _scan_files(self) -> tuple[list[KeyFields], list[int]]:
        """(keys, sizes) of the published files in the data directories, least recently used
        first; temp leftovers there are removed.  The data directories are the root and, when
        sharded, ``root/xx/yy``; nothing else (``quarantine/``, operator folders) is data.
        Walked by :mod:`kvpersist.inventory` (its C walker when built)."""
        inv = build_inventory(self.root)
        root = str(self.root)

        def is_data_dir(d: str) -> bool:
            if d == root:
                return True
            parts = d[len(root) + 1:].split("/") if d.startswith(root + "/") else []
            return self.sharded and len(parts) == 2 and all(len(p) == 2 for p in parts)

        in_data = np.array([is_data_dir(d) for d in inv.dirs], bool)[inv.dir_idx] \
            if inv.dirs else np.zeros(0, bool)
        for row in np.flatnonzero(in_data & (inv.cls == TEMP)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(inv.file(int(row)).fspath)
                self.stats.temp_removed += 1
        # ".kvp", not nixl_store_dynamic's ".bin": the third byte from each name's end (only
        # read for live/unparsable rows, whose names end in one of the two suffixes).
        kvp = np.frombuffer(inv.names, np.uint8)[np.maximum(inv.name_end - 3, 0)] == ord(SUFFIX[1]) \
            if len(inv) else np.zeros(0, bool)
        self.stats.unparsable_names += int(np.count_nonzero(in_data & kvp & (inv.cls == UNPARSABLE)))
        live = np.flatnonzero(in_data & kvp & (inv.cls == LIVE))
        live = live[np.argsort(inv.mtime_ns[live], kind="stable")]  # oldest access first = LRU
        return inv.keys(live), inv.size[live].tolist()

    # ------------------------------------------------------------------ lookup

    def contains(self, key: KeyFields) -> bool:
        """True if a file for ``key`` is known (or, during the scan, present on disk)."""
        with self._lock:
            if key in self._index:
                return True
        if self._scan_done.is_set():
            return False
        try:
            st = os.stat(self.path_for(key), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        self._index_add([(key, st.st_size)])
        return True

    # ------------------------------------------------------------------ store

    def put(self, key: KeyFields, payload: Any, layout: dict[str, Any] | None = None) -> str:
        """Publish ``payload`` for ``key``.  Returns 'stored', 'exists' or a rejection tag."""
        data = memoryview(payload).cast("B")
        size = HEADER_SIZE + data.nbytes
        with self._lock:
            if key in self._index:
                self.stats.store_exists += 1
                return "exists"
            if not self._scan_done.is_set():
                self.stats.rejected_scanning += 1
                return "rejected-scanning"
            if self._used + self._reserved + size > self.capacity_bytes:
                self.stats.rejected_capacity += 1
                return "rejected-capacity"
            self._reserved += size
        try:
            outcome = self._write(key, data, layout)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        if outcome == "stored":
            self._index_add([(key, size)], release_reserved=size)
            self.stats.stores += 1
            self.stats.stored_bytes += size
        else:
            with self._lock:
                self._reserved -= size
        return outcome

    def _write(self, key: KeyFields, data: memoryview, layout: dict[str, Any] | None) -> str:
        final = self.path_for(key)
        if self.sharded:
            final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{TMP_MARK}{secrets.token_hex(6)}")
        header = build_header(key, data.nbytes, payload_digest(data), layout)
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            _write_all(fd, header)
            _write_all(fd, data)
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
            return "stored"
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.rejected_disk_full += 1
                logger.warning("kvpersist L2: disk full, store of %s rejected", final.name)
                return "rejected-disk-full"
            self.stats.store_errors += 1
            logger.warning("kvpersist L2: store of %s failed: %s", final.name, exc)
            return "error"

    # ------------------------------------------------------------------ load

    def read_into(self, key: KeyFields, buf: Any) -> bool:
        """Fill ``buf`` with the verified payload of ``key``; False (a miss) otherwise."""
        began = time.perf_counter()
        self.stats.loads += 1
        path = self.path_for(key)
        out = memoryview(buf).cast("B")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            self._index_remove(key)  # vanished (cleanup, eviction race): an ordinary miss
            self.stats.load_misses += 1
            return False
        try:
            self.stats.verify_seconds += read_verified(fd, key, out)
        except FormatError as exc:
            os.close(fd)
            self._quarantine(path, key, exc.reason, str(exc))
            self.stats.load_misses += 1
            return False
        except OSError as exc:
            os.close(fd)
            logger.warning("kvpersist L2: read of %s failed: %s", path.name, exc)
            self.stats.load_misses += 1
            return False
        os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(path)  # last access, so the LRU order survives restarts
        self.stats.load_hits += 1
        self.stats.loaded_bytes += out.nbytes
        self.stats.load_seconds += time.perf_counter() - began
        return True

    def _quarantine(self, path: Path, key: KeyFields, reason: str, detail: str) -> None:
        self.stats.verify_failures[reason] += 1
        qdir = self.root / QUARANTINE_DIR
        try:
            count = sum(1 for _ in os.scandir(qdir))
        except OSError:
            count = self.quarantine_max_files
        try:
            if count < self.quarantine_max_files:
                action = f"moved to {quarantine_file(self.root, path, reason)}"
            else:
                os.unlink(path)
                action = "removed (quarantine full)"
        except FileNotFoundError:
            action = "already gone"
        except OSError as exc:
            action = f"could not be moved ({exc.strerror})"
        self.stats.quarantined += 1
        self._index_remove(key)
        logger.warning("kvpersist L2: verification failed for %s (%s); a miss, file %s",
                       path.name, detail, action)

    # ------------------------------------------------------------------ delete / list

    def delete(self, key: KeyFields) -> int | None:
        """Remove ``key``'s file; returns its accounted size, or None if it was not indexed."""
        path = self.path_for(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        size = self._index_remove(key)
        if size is not None:
            self.stats.evicted += 1
        return size

    def list_keys(self, model_name: str | None, offset: int, limit: int
                  ) -> tuple[list[tuple[KeyFields, int]], int | None]:
        """A page of (key, size) sorted by file name; returns the next offset or None."""
        with self._lock:
            if self._list_cache is None or self._list_cache[0] != self._version:
                self._list_cache = (self._version, sorted(self._index, key=format_name))
            ordered = self._list_cache[1]
            if model_name is not None:
                ordered = [k for k in ordered if k.model_name == model_name]
            page = [(k, self._index[k]) for k in ordered[offset:offset + limit] if k in self._index]
        next_offset = offset + limit if offset + limit < len(ordered) else None
        return page, next_offset

    def status(self) -> dict[str, Any]:
        with self._lock:
            files, used, reserved = len(self._index), self._used, self._reserved
        stats = self.stats
        quarantine_files = quarantine_bytes = 0
        with contextlib.suppress(OSError), os.scandir(self.root / QUARANTINE_DIR) as entries:
            for entry in entries:
                quarantine_files += 1
                with contextlib.suppress(OSError):
                    quarantine_bytes += entry.stat(follow_symlinks=False).st_size
        return {
            "root": str(self.root),
            "sharded": self.sharded,
            "files": files,
            "used_bytes": used,
            "reserved_bytes": reserved,
            "capacity_bytes": self.capacity_bytes,
            "usage_fraction": used / self.capacity_bytes,
            "scan_done": self._scan_done.is_set(),
            "scan_seconds": self._scan_seconds,
            "scan_error": self._scan_error,
            "scanned_files": self._scanned_files,
            "stores": stats.stores,
            "stored_bytes": stats.stored_bytes,
            "store_exists": stats.store_exists,
            "rejected": stats.rejected_capacity + stats.rejected_scanning + stats.rejected_disk_full,
            "rejected_capacity": stats.rejected_capacity,
            "rejected_scanning": stats.rejected_scanning,
            "rejected_disk_full": stats.rejected_disk_full,
            "store_errors": stats.store_errors,
            "loads": stats.loads,
            "load_hits": stats.load_hits,
            "load_misses": stats.load_misses,
            "loaded_bytes": stats.loaded_bytes,
            "load_seconds": round(stats.load_seconds, 6),
            "verify_seconds": round(stats.verify_seconds, 6),
            "verify_failures": sum(stats.verify_failures.values()),
            "verify_failures_by_reason": dict(stats.verify_failures),
            "quarantined": stats.quarantined,
            "quarantine_files": quarantine_files,
            "quarantine_bytes": quarantine_bytes,
            "evicted": stats.evicted,
            "temp_removed": stats.temp_removed,
            "unparsable_names": stats.unparsable_names,
        }


def read_verified(fd: int, key: KeyFields, out: memoryview) -> float:
    """Fill ``out`` from the open file ``fd`` if, and only if, it is exactly ``key``'s object.

    Checks header (magic, version, digest), key, payload length, file size and payload digest;
    raises FormatError with a reason tag otherwise.  Returns the seconds spent on the payload
    digest.  On failure ``out`` may hold garbage: callers must treat it as unfilled.
    """
    header = parse_header(os.pread(fd, HEADER_SIZE, 0))
    check_header(header, key, out.nbytes)
    file_size = os.fstat(fd).st_size
    if file_size != HEADER_SIZE + out.nbytes:
        raise FormatError("size-mismatch", f"{file_size} bytes on disk")
    # Hash each segment right after reading it, while it is still in the CPU cache.
    hasher = payload_hasher()
    spent = 0.0
    done = 0
    while done < out.nbytes:
        segment = out[done:done + _VERIFY_SEGMENT]
        got = _read_all(fd, segment, HEADER_SIZE + done)
        began = time.perf_counter()
        hasher.update(segment[:got])
        spent += time.perf_counter() - began
        done += got
        if got < segment.nbytes:
            raise FormatError("truncated", f"{done} of {out.nbytes} bytes")
    if hasher.digest() != header.checksum:
        raise FormatError("payload-checksum")
    return spent


def verify_file(path: Path) -> tuple[str | None, int]:
    """Scrub one ``.kvp`` file against its own name; (failure reason or None, bytes read)."""
    try:
        key = parse_name(path.name)
    except FormatError as exc:
        return exc.reason, 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"unreadable ({exc.strerror})", 0
    try:
        try:
            header = parse_header(os.pread(fd, HEADER_SIZE, 0))
        except FormatError as exc:
            return exc.reason, 0
        buf = bytearray(max(0, min(header.payload_len, os.fstat(fd).st_size)))
        try:
            read_verified(fd, key, memoryview(buf))
        except FormatError as exc:
            return exc.reason, len(buf)
        return None, HEADER_SIZE + len(buf)
    finally:
        os.close(fd)


def quarantine_file(root: Path, path: Path, reason: str) -> Path:
    """Move ``path`` into ``root/quarantine`` with the reason in its name; returns the target."""
    qdir = root / QUARANTINE_DIR
    qdir.mkdir(mode=0o700, exist_ok=True)
    target = qdir / f"{path.name}.{reason}.{time.time_ns()}"
    os.rename(path, target)
    return target


def _take_root_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RootLockedError(
            f"cache root {path.parent} is already served by another kvpersist L2 store "
            f"(pid {holder}); one writer per root: stop that server or use another KVP_CACHE_ROOT"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _read_all(fd: int, out: memoryview, offset: int) -> int:
    total = 0
    while total < out.nbytes:
        n = os.preadv(fd, [out[total:]], offset + total)
        if n <= 0:
            break
        total += n
    return total
