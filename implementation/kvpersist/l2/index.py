"""The store's bookkeeping: which keys have a published file, their accounted sizes, the bytes
reserved by stores in flight; no I/O.

Invariants (all under one lock)
-------------------------------
* ``used_bytes`` is the sum of the sizes in the index; ``reserved_bytes`` the sum of the
  reservations of stores in flight.
* Once the index is complete (the start-up scan has finished), ``used + reserved <= capacity``
  always holds: a store reserves its size first and is refused if it does not fit; a finished
  store turns its reservation into usage in one critical section, so the sum never dips.
  While it is incomplete, every reservation is refused (the count is not yet known).
* ``on_added``/``on_removed`` are called outside the lock, once per change, with exactly the
  keys and sizes that entered or left ``used_bytes``.
* The index's order is least recently used first: entries are appended as they are added (the
  scan adds them oldest access first) and :meth:`KeyIndex.touch` moves a read key to the end,
  as a read moves its file's mtime (the order a snapshot keeps across a clean restart).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from enum import Enum

from .layout import KeyFields, format_name

KeysCallback = Callable[[list[KeyFields], list[int]], None]


class Reservation(Enum):
    GRANTED = "granted"
    EXISTS = "exists"
    REJECTED_SCANNING = "rejected-scanning"
    REJECTED_CAPACITY = "rejected-capacity"


def _ignore(keys: list[KeyFields], sizes: list[int]) -> None:
    return None


class KeyIndex:
    """key → accounted size (header included), with reservations (see module invariants)."""

    def __init__(self, capacity_bytes: int, *, on_added: KeysCallback | None = None,
                 on_removed: KeysCallback | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._on_added = on_added or _ignore
        self._on_removed = on_removed or _ignore
        self._lock = threading.Lock()
        self._sizes: dict[KeyFields, int] = {}
        self._used = 0
        self._reserved = 0
        self._complete = False
        self._version = 0
        self._sorted: tuple[int, list[KeyFields]] | None = None

    # -- state
    def mark_complete(self) -> None:
        with self._lock:
            self._complete = True

    @property
    def complete(self) -> bool:
        with self._lock:
            return self._complete

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved

    def totals(self) -> tuple[int, int, int]:
        """(files, used bytes, reserved bytes), consistent with each other."""
        with self._lock:
            return len(self._sizes), self._used, self._reserved

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._sizes

    def snapshot(self) -> dict[KeyFields, int]:
        with self._lock:
            return dict(self._sizes)

    # -- stores
    def reserve(self, key: KeyFields, size: int, *, outside: int = 0) -> Reservation:
        """Reserve ``size`` bytes for a store of ``key``; ``outside``: bytes the caller keeps
        under the same cap outside the index (the quarantine)."""
        with self._lock:
            if key in self._sizes:
                return Reservation.EXISTS
            if not self._complete:
                return Reservation.REJECTED_SCANNING
            if self._used + self._reserved + outside + size > self.capacity_bytes:
                return Reservation.REJECTED_CAPACITY
            self._reserved += size
            return Reservation.GRANTED

    def release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def commit(self, key: KeyFields, size: int) -> None:
        """A granted store published its file: its reservation becomes usage."""
        self.add([(key, size)], release_reserved=size)

    # -- changes
    def add(self, items: Iterable[tuple[KeyFields, int]], *, release_reserved: int = 0) -> int:
        """Add entries not yet present (a key given twice in ``items`` counts once, at its last
        size); returns how many were added.  No Python loop runs per entry: a start-up scan
        adds a million entries through here."""
        fresh = dict(items)
        with self._lock:
            self._reserved -= release_reserved
            if self._sizes:
                for key in fresh.keys() & self._sizes.keys():
                    del fresh[key]
            if fresh:
                self._sizes.update(fresh)
                self._used += sum(fresh.values())
                self._version += 1
        if fresh and self._on_added is not _ignore:
            self._on_added(list(fresh), list(fresh.values()))
        return len(fresh)

    def adopt_scan(self, scanned: dict[KeyFields, int]) -> int:
        """Make the start-up scan's ``scanned`` (built outside the lock, least recently used
        first; taken over, not copied) the index in one step; returns how many entries it
        added.  Entries added meanwhile (lookups that found a file on disk while the scan ran)
        are kept and counted once, after the scanned ones.  Only while the index is incomplete.
        Under the lock no Python code runs per scanned entry: one pass per entry added
        meanwhile, and C-speed passes over the dict (its byte sum, the announcement's lists when
        someone listens)."""
        with self._lock:
            if self._complete:
                raise RuntimeError("the index is complete: a scan cannot be adopted")
            early = self._sizes
            for key in early.keys() & scanned.keys():
                del scanned[key]
            added = len(scanned)
            announce = ((list(scanned), list(scanned.values()))
                        if added and self._on_added is not _ignore else None)
            self._used += sum(scanned.values())
            scanned.update(early)
            self._sizes = scanned
            self._version += 1
        if announce is not None:
            self._on_added(*announce)
        return added

    def touch(self, key: KeyFields) -> None:
        """``key`` was just read: it becomes the most recently used entry."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._sizes[key] = size

    def ordered(self) -> tuple[list[KeyFields], list[int], int]:
        """(keys least recently used first, their sizes, bytes reserved by stores in flight),
        consistent with each other."""
        with self._lock:
            return list(self._sizes), list(self._sizes.values()), self._reserved

    def remove_if_gone(self, key: KeyFields, present: Callable[[], bool]) -> int | None:
        """Drop ``key`` unless ``present()`` (asked under the lock, so no store can publish and
        commit ``key`` in between) says its file is there: a reader that found the file absent
        never drops a key a concurrent store has just re-published.  The one call of the index
        that does I/O (``present``, a stat), only on that rare path."""
        return self._drop(key, present)

    def remove(self, key: KeyFields) -> int | None:
        """Drop ``key``; its accounted size, or None if it was not indexed."""
        return self._drop(key, None)

    def _drop(self, key: KeyFields, present: Callable[[], bool] | None) -> int | None:
        with self._lock:
            if key not in self._sizes or (present is not None and present()):
                return None
            size = self._sizes.pop(key)
            self._used -= size
            self._version += 1
        self._on_removed([key], [size])
        return size

    def drain(self) -> int:
        """Drop every entry and mark the index incomplete (stores refused), for a root given up
        (its device lost): ``on_removed`` hears of exactly the entries that left ``used_bytes``,
        so the accounting drops the root's bytes.  Returns how many entries left."""
        with self._lock:
            gone, self._sizes = self._sizes, {}
            self._used -= sum(gone.values())
            self._complete = False
            self._version += 1
        if gone and self._on_removed is not _ignore:
            self._on_removed(list(gone), list(gone.values()))
        return len(gone)

    # -- listing
    def page(self, model_name: str | None, offset: int, limit: int
             ) -> tuple[list[tuple[KeyFields, int]], int | None]:
        """A page of (key, size) sorted by file name; returns the next offset or None.

        The sort (seconds at a million keys) runs outside the lock on a copy of the keys taken
        under it (a C-speed copy), and is kept until the index changes: listing never holds the
        lock that every lookup and store takes for longer than that copy and one page."""
        with self._lock:
            version, cached = self._version, self._sorted
            keys = list(self._sizes) if cached is None or cached[0] != version else None
        if keys is not None:
            ordered = sorted(keys, key=format_name)
            with self._lock:
                if self._version == version:
                    self._sorted = (version, ordered)
        else:
            assert cached is not None
            ordered = cached[1]
        if model_name is not None:
            ordered = [k for k in ordered if k.model_name == model_name]
        window = ordered[offset:offset + limit]
        with self._lock:
            page = [(k, self._sizes[k]) for k in window if k in self._sizes]
        next_offset = offset + limit if offset + limit < len(ordered) else None
        return page, next_offset
