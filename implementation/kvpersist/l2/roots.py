"""One tier over several roots, one per device: a :class:`KvFileStore` per root, each key on the
root :func:`~kvpersist.l2.placement.place` picks, and a root whose device fails given up alone.

Invariants
----------
* **Placement by key**: a store goes to the key's placed root; a lookup, read or delete asks
  the placed root first, then the other roots' indexes (in memory, no I/O), so a key written
  before roots were added or removed is still found, and a key any root holds is never stored
  a second time ('exists'): nothing is counted twice.
* **Per device and in total**: each root's store keeps its own index, cap (its share of the
  budget), quarantine and counters; totals are their sums.  :meth:`RootSet.usage_fraction`
  is the fullest healthy root's, so LMCache's watermark eviction runs as soon as any device
  reaches it.
* **A lost device costs only its keys** (several roots only): a root whose :func:`probe`
  fails (gone, unmounted or replaced, read-only, EIO, ESTALE, no answer within
  ``probe_timeout_s``) is *degraded*: no new operation is sent to it, and once those in flight
  have finished its store is abandoned, which drains its index, so the accounting drops exactly
  its bytes; the other roots serve on.  A degraded root is probed again every
  ``probe_interval_s``; when it answers as the same device (its marker), and its old store has
  been abandoned, a new store opens it and its start-up scan announces its files again: it
  rejoins.
* **Nothing waits for a device that does not answer**: degrading never blocks.  Operations
  stuck in the kernel on a hung device (D-state reads that no signal ends) keep its store
  until the last of them returns, which abandons it; until then the root is degraded with
  ``in_flight`` operations in its status, its counters are still reported, and the watch
  goes on probing every root.
* **Counters never go back**: an abandoned store's counters are kept, so per-root and total
  counters stay monotonic across a degrade and a rejoin.
* With a single root nothing is probed and nothing is given up: a failing device is then the
  whole tier, and its faults are misses counted by the store, as they always were.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .index import KeysCallback
from .layout import KeyFields
from .lease import Lease
from .placement import rank
from .root_health import RootRefused, RootRegister, claim, probe
from .store import KvFileStore

logger = logging.getLogger("kvpersist.l2")

StoreFactory = Callable[[Path, int, KeysCallback, KeysCallback], KvFileStore]

HEALTHY = "healthy"
DEGRADED = "degraded"
#: Status fields that are not summed over the roots.
_NOT_SUMMED = frozenset({"root", "sharded", "usage_fraction", "scan_done", "scan_seconds",
                         "in_flight",
                         "scan_source", "scan_error", "direct_io", "shared_tree",
                         "verify_failures_by_reason", "since", "degrades"})
#: Summed, but sizes of what a root holds now: not carried past an abandoned store.
_GAUGES = frozenset({"files", "used_bytes", "reserved_bytes", "capacity_bytes",
                     "quarantine_files", "quarantine_bytes", "scanned_files"})


@dataclass
class _Root:
    path: Path
    capacity: int
    store: KvFileStore | None = None
    state: str = DEGRADED
    reason: str | None = "not opened yet"
    since: float = field(default_factory=time.time)
    identity: str | None = None
    in_flight: int = 0
    degrades: int = 0
    carried: Counter[str] = field(default_factory=Counter)
    carried_reasons: Counter[str] = field(default_factory=Counter)
    probing: bool = False
    #: its store is being abandoned (by the degrade, or by the last operation to return)
    abandoning: bool = False

    @property
    def name(self) -> str:
        return str(self.path)


#: How many keys' orders of roots :class:`RootSet` keeps (a 1M-token chat is 4,096 chunks).
RANK_CACHE_KEYS = 16384


class RootSet:
    """The tier's roots (see module invariants).  ``capacities[i]`` is root ``i``'s share of
    the budget; ``paths[0]`` is the primary root (it keeps the register of root ids)."""

    def __init__(self, paths: Sequence[Path], capacities: Sequence[int], factory: StoreFactory,
                 *, on_added: KeysCallback, on_removed: KeysCallback,
                 probe_interval_s: float = 2.0, probe_timeout_s: float = 10.0) -> None:
        if not paths or len(paths) != len(capacities):
            raise ValueError("one capacity per root, and at least one root")
        names = [str(Path(p)) for p in paths]
        if len(set(names)) != len(names):
            raise ValueError(f"a root is given twice: {names}")
        self._roots = [_Root(Path(p), int(c)) for p, c in zip(paths, capacities, strict=True)]
        self._names = names
        #: Each key's order of roots, kept for the keys of the last few restores: a restore
        #: asks for the same keys three times (lookup, the load's dispatch, the read) and the
        #: rendezvous hash costs a few microseconds per key and root.
        self._rank: Callable[[KeyFields], list[int]] = functools.lru_cache(
            maxsize=RANK_CACHE_KEYS)(functools.partial(rank, roots=tuple(names)))
        self._factory = factory
        self._on_added = on_added
        self._on_removed = on_removed
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._lock = threading.Condition()
        self._closing = threading.Event()
        self._wake = threading.Event()
        self._monitor: threading.Thread | None = None
        self._register = RootRegister(self._roots[0].path)
        self._background_scan = True

    @property
    def several(self) -> bool:
        return len(self._roots) > 1

    @property
    def root(self) -> Path:
        return self._roots[0].path

    @property
    def paths(self) -> list[Path]:
        return [r.path for r in self._roots]

    # ------------------------------------------------------------------ lifecycle

    def open(self, *, background_scan: bool = True) -> None:
        """Open every root; with several roots, one that fails to open is degraded (and probed
        again), and another server's lock on a root (``RootLockedError``) is raised."""
        self._background_scan = background_scan
        if not self.several:
            self._attach(self._roots[0])
            return
        for root in self._roots:
            self._try_attach(root)
        self._monitor = threading.Thread(target=self._watch, name="kvpersist-l2-roots",
                                         daemon=True)
        self._monitor.start()

    def _new_store(self, root: _Root) -> KvFileStore:
        holder: list[KvFileStore] = []

        def added(keys: list[KeyFields], sizes: list[int]) -> None:
            if root.store is holder[0]:
                self._on_added(keys, sizes)

        def removed(keys: list[KeyFields], sizes: list[int]) -> None:
            if root.store is holder[0]:
                self._on_removed(keys, sizes)

        store = self._factory(root.path, root.capacity, added, removed)
        holder.append(store)
        return store

    def _attach(self, root: _Root) -> None:
        store = self._new_store(root)
        with self._lock:
            root.store = store  # before open: the scan's announcement must pass the gate
        try:
            store.open(background_scan=self._background_scan)
        except BaseException:
            with self._lock:
                root.store = None
            raise
        with self._lock:
            root.state, root.reason, root.since = HEALTHY, None, time.time()

    def _try_attach(self, root: _Root) -> bool:
        try:
            root.identity = claim(root.path, self._register)
            why = probe(root.path, root.identity)
            if why is not None:
                raise OSError(why)
            self._attach(root)
        except (OSError, RootRefused) as exc:
            reason = str(exc)
            with self._lock:
                changed = root.reason != reason
                root.state, root.reason = DEGRADED, reason
            if changed:
                logger.error("kvpersist L2: root %s is degraded: %s; its keys miss, the other "
                             "roots serve", root.path, reason)
            return False
        logger.info("kvpersist L2: root %s serves (id %s)", root.path, root.identity)
        return True

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.probe_timeout_s + 5)
        for root in self._roots:
            with self._lock:
                store, root.store = root.store, None
                healthy = root.state == HEALTHY
            if store is not None and healthy:
                store.close()

    # ------------------------------------------------------------------ health

    def _watch(self) -> None:
        while not self._closing.is_set():
            for root in self._roots:
                if self._closing.is_set():
                    return
                self._check(root)
            self._wake.wait(self.probe_interval_s)
            self._wake.clear()

    def _check(self, root: _Root) -> None:
        if root.state == HEALTHY:
            assert root.identity is not None
            why = self._probe_in_time(root, root.identity)
            if why is not None:
                self.degrade(root.path, why)
        elif root.store is not None:
            return  # operations of its last life are still in flight: no new store before
        elif root.identity is None or self._probe_in_time(root, root.identity) is None:
            self._try_attach(root)

    def _probe_in_time(self, root: _Root, identity: str) -> str | None:
        """:func:`probe` on its own thread: a device that does not answer within
        ``probe_timeout_s`` is a fault (the thread is left to finish; one at a time per root)."""
        if root.probing:
            return f"{root.path} has not answered a probe for over {self.probe_timeout_s:.0f}s"
        result: list[str | None] = []

        def run() -> None:
            try:
                result.append(probe(root.path, identity))
            finally:
                root.probing = False

        root.probing = True
        thread = threading.Thread(target=run, name="kvpersist-l2-probe", daemon=True)
        thread.start()
        thread.join(self.probe_timeout_s)
        if not result:
            return f"{root.path} did not answer a probe within {self.probe_timeout_s:.0f}s"
        return result[0]

    def suspect(self) -> None:
        """An operation on a root failed: probe every root now rather than at the next
        interval."""
        if self.several:
            self._wake.set()

    def degrade(self, path: Path, reason: str) -> None:
        """Give root ``path`` up (see module invariants); no-op if it is degraded already.
        Never waits: a store with operations in flight is abandoned by the last to return."""
        root = self._roots[self._names.index(str(Path(path)))]
        with self._lock:
            if root.state != HEALTHY:
                return
            root.state, root.reason, root.since = DEGRADED, reason, time.time()
            root.degrades += 1
            waiting = root.in_flight
        logger.error("kvpersist L2: root %s is degraded: %s; its keys miss, the other roots "
                     "serve, and it is probed again every %.1fs", path, reason,
                     self.probe_interval_s)
        if waiting:
            logger.error("kvpersist L2: root %s: %d operation(s) still in flight on it; its keys "
                         "leave the accounting when the last returns", path, waiting)
        self._abandon_if_drained(root)

    def _abandon_if_drained(self, root: _Root) -> None:
        """Abandon a degraded root's store once no operation is in flight on it (once: the
        degrade and the last returning operation may both ask)."""
        with self._lock:
            if (root.state == HEALTHY or root.in_flight or root.store is None
                    or root.abandoning):
                return
            root.abandoning, store = True, root.store
        try:
            status = store.status()
            dropped = store.abandon()
        finally:
            with self._lock:
                root.store, root.abandoning = None, False
        with self._lock:
            root.carried.update({k: v for k, v in status.items()
                                 if _is_counter(k, v) and k not in _GAUGES})
            root.carried_reasons.update(status.get("verify_failures_by_reason") or {})
        logger.error("kvpersist L2: root %s: %d keys dropped from the accounting", root.path,
                     dropped)

    # ------------------------------------------------------------------ routing

    @contextlib.contextmanager
    def _using(self, index: int) -> Iterator[KvFileStore | None]:
        """Root ``index``'s store while it serves (None when degraded), counted in flight."""
        root = self._roots[index]
        with self._lock:
            store = root.store if root.state == HEALTHY else None
            if store is not None:
                root.in_flight += 1
        try:
            yield store
        finally:
            if store is not None:
                with self._lock:
                    root.in_flight -= 1
                    drained = root.in_flight == 0 and root.state != HEALTHY
                if drained:  # the last operation of a degraded root abandons its store
                    self._abandon_if_drained(root)

    def root_index(self, key: KeyFields) -> int:
        """The root an operation on ``key`` goes to (whose file threads it should use)."""
        return self._holder(key)

    def _holder(self, key: KeyFields) -> int:
        """The root holding ``key``: the placed one unless another healthy root indexes it."""
        return self._find(key)[0]

    def _find(self, key: KeyFields) -> tuple[int, int]:
        """(the root holding ``key``, the root placement picks for it).  The indexes are read
        without counting an operation in flight: a root degraded meanwhile is caught by the
        :meth:`_using` that the caller's operation goes through."""
        if not self.several:
            return 0, 0
        order = self._rank(key)
        for i in order:
            root = self._roots[i]
            store = root.store if root.state == HEALTHY else None
            if store is not None and key in store.index:
                return i, order[0]
        return order[0], order[0]

    def put(self, key: KeyFields, payload: Any, layout: dict[str, Any] | None = None,
            lease: Lease | None = None) -> str:
        """The store's outcome on the placed root, 'exists' when another root holds the key,
        'degraded' when the placed root is."""
        holder, placed = self._find(key)
        with self._using(holder) as store:
            if store is None:
                return "degraded"
            if holder != placed:
                return "exists"
            return store.put(key, payload, layout, lease)

    def read_into(self, key: KeyFields, buf: Any, lease: Lease | None = None) -> bool:
        with self._using(self._holder(key)) as store:
            if store is None:
                return False
            # a lease that ended is judged before the read, so that a miss the device causes
            # meanwhile still draws a probe
            late = lease is not None and lease.expired()
            hit = store.read_into(key, buf, lease)
            if not hit and not late and key in store.index:
                self.suspect()  # an indexed file missed: the device may be failing
            return hit

    def contains(self, key: KeyFields) -> bool:
        with self._using(self._holder(key)) as store:
            return store is not None and store.contains(key)

    def contains_many(self, keys: list[KeyFields]) -> list[bool]:
        if not self.several:
            with self._using(0) as store:
                return [False] * len(keys) if store is None else store.contains_many(keys)
        by_root: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_root.setdefault(self._holder(key), []).append(i)
        hits = [False] * len(keys)
        for index, positions in by_root.items():
            with self._using(index) as store:
                if store is None:
                    continue
                for pos, hit in zip(positions, store.contains_many([keys[p] for p in positions]),
                                    strict=True):
                    hits[pos] = hit
        return hits

    def delete(self, key: KeyFields) -> int | None:
        with self._using(self._holder(key)) as store:
            return None if store is None else store.delete(key)

    def quarantine_key(self, key: KeyFields, reason: str, detail: str) -> None:
        with self._using(self._holder(key)) as store:
            if store is not None:
                store.quarantine_key(key, reason, detail)

    def path_for(self, key: KeyFields) -> Path:
        with self._using(self._holder(key)) as store:
            if store is not None:
                return store.path_for(key)
        raise FileNotFoundError(f"the root of {key} is degraded")

    def indexed_sizes(self) -> dict[KeyFields, int]:
        """Every healthy root's index, merged (for tests and checks)."""
        merged: dict[KeyFields, int] = {}
        for i in range(len(self._roots)):
            with self._using(i) as store:
                if store is not None:
                    merged.update(store.index.snapshot())
        return merged

    def indexed(self, key: KeyFields) -> bool:
        with self._using(self._holder(key)) as store:
            return store is not None and key in store.index

    def list_keys(self, model_name: str | None, cursor: str | None, limit: int
                  ) -> tuple[list[tuple[KeyFields, int]], str | None]:
        """A page of (key, size), root by root, each root's keys sorted by file name; the
        cursor is ``<offset>`` in the primary root or ``<root>:<offset>``."""
        index, offset = _parse_cursor(cursor, len(self._roots))
        page: list[tuple[KeyFields, int]] = []
        while index < len(self._roots) and len(page) < limit:
            with self._using(index) as store:
                more, next_offset = ([], None) if store is None else store.list_keys(
                    model_name, offset, limit - len(page))
            page += more
            if next_offset is None:
                index, offset = index + 1, 0
            else:
                offset = next_offset
        if index >= len(self._roots):
            return page, None
        return page, str(offset) if index == 0 else f"{index}:{offset}"

    # ------------------------------------------------------------------ state

    def _live(self) -> list[tuple[_Root, KvFileStore]]:
        with self._lock:
            return [(r, r.store) for r in self._roots
                    if r.state == HEALTHY and r.store is not None]

    @property
    def capacity_bytes(self) -> int:
        return sum(r.capacity for r in self._roots)

    @property
    def healthy_capacity_bytes(self) -> int:
        return sum(root.capacity for root, _ in self._live())

    @property
    def used_bytes(self) -> int:
        return sum(store.used_bytes for _, store in self._live())

    def __len__(self) -> int:
        return sum(len(store) for _, store in self._live())

    @property
    def scan_done(self) -> bool:
        return all(store.scan_done for _, store in self._live())

    @property
    def scan_error(self) -> str | None:
        for root, store in self._live():
            if store.scan_error is not None:
                return (store.scan_error if not self.several
                        else f"{root.path}: {store.scan_error}")
        return None

    def wait_scan(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, store in self._live():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not store.wait_scan(left):
                return False
        return True

    def usage_fraction(self) -> float:
        """The fullest healthy root's used fraction of its own cap (0 when none serves)."""
        return max((store.used_bytes / root.capacity for root, store in self._live()),
                   default=0.0)

    @property
    def degraded(self) -> list[tuple[Path, str]]:
        with self._lock:
            return [(r.path, r.reason or "") for r in self._roots if r.state != HEALTHY]

    def roots_status(self) -> list[dict[str, Any]]:
        out = []
        for root in self._roots:
            with self._lock:
                store = root.store if root.state == HEALTHY else None
                draining = root.store if root.state != HEALTHY else None
                entry: dict[str, Any] = {
                    "root": root.name, "state": root.state, "reason": root.reason,
                    "since": round(root.since, 3), "degrades": root.degrades,
                    "capacity_bytes": root.capacity, "in_flight": root.in_flight}
                carried, reasons = Counter(root.carried), Counter(root.carried_reasons)
            status: dict[str, Any] = store.status() if store is not None else {
                "files": 0, "used_bytes": 0, "reserved_bytes": 0, "quarantine_files": 0,
                "quarantine_bytes": 0}
            if draining is not None:  # degraded, not abandoned yet: its counters still count
                old = draining.status()
                status.update({k: v for k, v in old.items()
                               if _is_counter(k, v) and k not in _GAUGES})
                status["verify_failures_by_reason"] = old.get("verify_failures_by_reason")
            for key, value in carried.items():
                status[key] = status.get(key, 0) + value
            status["verify_failures_by_reason"] = dict(
                reasons + Counter(status.get("verify_failures_by_reason") or {}))
            status["usage_fraction"] = status["used_bytes"] / root.capacity
            entry.update({k: v for k, v in status.items() if k not in entry})
            out.append(entry)
        return out

    def status(self) -> dict[str, Any]:
        """The single root's status as ever; with several, totals over the roots (counters of
        every root, sizes of the healthy ones) and ``roots``, one entry per root."""
        roots = self.roots_status()
        if not self.several:
            only = roots[0]
            return {k: v for k, v in only.items()
                    if k not in ("state", "reason", "since", "degrades", "in_flight")}
        total: dict[str, Any] = {"root": str(self.root), "roots": roots}
        for entry in roots:
            for key, value in entry.items():
                if _is_counter(key, value):
                    total[key] = total.get(key, 0) + value
        total["capacity_bytes"] = self.capacity_bytes
        total["usage_fraction"] = total.get("used_bytes", 0) / self.capacity_bytes
        total["verify_failures_by_reason"] = dict(sum(
            (Counter(e.get("verify_failures_by_reason") or {}) for e in roots), Counter()))
        live = [e for e in roots if e["state"] == HEALTHY]
        total["scan_done"] = all(e.get("scan_done") for e in live)
        total["scan_error"] = next((f"{e['root']}: {e['scan_error']}" for e in live
                                    if e.get("scan_error")), None)
        total["degraded_roots"] = [{"root": e["root"], "reason": e["reason"]}
                                   for e in roots if e["state"] != HEALTHY]
        total["root_used_bytes"] = {e["root"]: e["used_bytes"] for e in roots}
        total["root_capacity_bytes"] = {e["root"]: e["capacity_bytes"] for e in roots}
        total["root_files"] = {e["root"]: e["files"] for e in roots}
        total["root_degraded"] = {e["root"]: int(e["state"] != HEALTHY) for e in roots}
        return total

    def check(self, *, deep: bool = False) -> list[str]:
        """Every healthy root's :meth:`KvFileStore.check`, plus: no key indexed on two roots."""
        problems: list[str] = []
        seen: dict[KeyFields, Path] = {}
        for root, store in self._live():
            prefix = f"{root.path}: " if self.several else ""
            problems += [prefix + p for p in store.check(deep=deep)]
            for key in store.index.snapshot():
                if key in seen:
                    problems.append(f"{key} indexed on {seen[key]} and on {root.path}")
                seen[key] = root.path
        return problems


def shares(total: int, roots: int) -> list[int]:
    """``total`` bytes split over ``roots`` equal shares (the first ones take the remainder)."""
    if roots <= 0:
        raise ValueError("at least one root")
    base, extra = divmod(total, roots)
    return [base + (1 if i < extra else 0) for i in range(roots)]


def _is_counter(key: str, value: Any) -> bool:
    return (key not in _NOT_SUMMED and isinstance(value, int | float)
            and not isinstance(value, bool))


def _parse_cursor(cursor: str | None, roots: int) -> tuple[int, int]:
    if cursor is None:
        return 0, 0
    head, _, tail = cursor.rpartition(":")
    try:
        index, offset = (int(head) if head else 0), int(tail)
    except ValueError:
        raise ValueError(f"malformed cursor {cursor!r}") from None
    if not 0 <= index < roots or offset < 0:
        raise ValueError(f"malformed cursor {cursor!r}")
    return index, offset
