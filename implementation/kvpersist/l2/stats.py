"""The store's counters since start.

Invariant: every update goes through :meth:`StoreStats.add` or :meth:`StoreStats.failed`, under
the counters' own lock, so concurrent I/O threads never lose a count; :meth:`as_dict` is a
consistent copy.  The one exception is ``read_progress`` (``read_bytes``), added to by the reading
threads segment by segment without that lock (:mod:`kvpersist.l2.read_loop`); it is a
progress signal, read as it stands.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .read_loop import ReadCounter


@dataclass
class StoreStats:
    """Counters since start; ``verify_failures`` is keyed by reason tag."""

    stores: int = 0
    stored_bytes: int = 0
    store_exists: int = 0
    store_exists_elsewhere: int = 0  # shared tree: another node's part has the key
    rejected_capacity: int = 0
    rejected_scanning: int = 0
    rejected_disk_full: int = 0
    store_errors: int = 0
    #: stores given up, unpublished, because LMCache's lock on their L1 object had lapsed or
    #: would have before their payload was read in full (:mod:`kvpersist.l2.lease`)
    store_lease_expired: int = 0
    #: reads that failed for another reason than the file's absence or its checks (EMFILE,
    #: EACCES, EIO, ...): misses that leave the index and the disk as they were
    read_errors: int = 0
    #: deletions whose unlink failed (not for absence): the file and its count stay
    delete_errors: int = 0
    loads: int = 0
    load_hits: int = 0
    load_misses: int = 0
    #: loads not read because LMCache's lock on their L1 buffer had lapsed (misses)
    load_lease_expired: int = 0
    loaded_bytes: int = 0  # verified payload bytes handed to LMCache
    load_seconds: float = 0.0
    verify_seconds: float = 0.0
    foreign_hits: int = 0  # shared tree: verified loads from another node's part
    foreign_failures: int = 0  # shared tree: such files that failed to read or verify (misses)
    quarantined: int = 0
    evicted: int = 0
    temp_removed: int = 0
    unparsable_names: int = 0
    #: files of an earlier version's ambiguous names renamed by the start-up scan
    migrated_names: int = 0
    verify_failures: Counter[str] = field(default_factory=Counter)
    #: payload bytes read so far, failed reads included (load progress; ``read_bytes``)
    read_progress: ReadCounter = field(default_factory=ReadCounter, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def failed(self, reason: str, *, count_miss: bool = True) -> None:
        with self._lock:
            self.verify_failures[reason] += 1
            self.quarantined += 1
            self.load_misses += int(count_miss)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if not f.name.startswith("_") and f.name != "read_progress"}
        out["read_bytes"] = self.read_progress.value
        failures: Counter[str] = out.pop("verify_failures")
        out["rejected"] = out["rejected_capacity"] + out["rejected_scanning"] \
            + out["rejected_disk_full"]
        out["load_seconds"] = round(out["load_seconds"], 6)
        out["verify_seconds"] = round(out["verify_seconds"], 6)
        out["verify_failures"] = sum(failures.values())
        out["verify_failures_by_reason"] = dict(failures)
        return out
