"""How a restore larger than free L1 passes through it: the window rules (pure, no LMCache).

Terms.  A restore asks for a conversation's prefix, one *column* per chunk; a column has one
object per *row* (a KV rank of an object group).  A column is *present* when every row's object
is in L1 or L2.  The *promised prefix* is the run of present columns from column 0.

Invariants
----------
* **Lookup window** (:func:`plan_lookup_window`): a lookup loads from L2 only the first columns
  whose L2 bytes fit in one window (at least one column); the rest of the promised prefix is
  *deferred*.  ``loaded <= prefix``; nothing is deferred when the window holds the prefix.
* **A deferred promise is kept only on a loaded window**: the hit reported for a lookup is the
  promised prefix only if every column of the lookup window landed (:func:`promised_hit`);
  otherwise it is what landed, so a hit never covers a hole.
* **Streamed retrieve** (:func:`retrieve_segments`): the columns a lookup locked are served
  first, as they are; the deferred ones follow in windows of ``window_columns``, each loaded,
  handed to the engine and released before the window after the next is loaded (at most
  ``IN_FLIGHT_WINDOWS`` in L1 per restore).  The segments tile ``[start, end)`` exactly,
  in order, without overlap.
* **Eviction on demand** (:func:`pick_evictions`): only *clean* objects (already in L2) that
  nobody holds are evicted, oldest first, and no more than the bytes asked for (plus the last
  object that crosses the line).
* **A cut restore keeps what was served** (:class:`ServedPrefixes`): a retrieve that fails after
  handing over its first ``k`` columns records ``k`` for its (request, worker instance) before
  its failed reply is sent; every retrieve clears the record of its pair first, so a record
  always describes the latest retrieve of that pair.  The worker keeps the blocks of those
  ``k`` columns out of the load errors (:func:`served_blocks`): vLLM recomputes from the
  failed chunk on, never a hole and never the whole prefix.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

#: The server's admin route a worker asks, after a failed retrieve, how many chunks it was
#: handed (``{"request_id", "instance_id", "served_chunks"}``; 404 without a record).
SERVED_ROUTE = "/kvpersist/restores/{instance_id}/{request_id:path}"
#: Failed retrieves remembered for their workers (oldest forgotten first).
SERVED_RECORDS = 4096
#: Windows of one streamed restore held in L1 at once: the one being handed over and the next.
IN_FLIGHT_WINDOWS = 2
_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


@dataclass(frozen=True)
class WindowPlan:
    """``[0, loaded)`` is loaded by the lookup; ``[loaded, prefix)`` is deferred to the
    retrieve."""

    loaded: int
    prefix: int

    @property
    def deferred(self) -> int:
        return self.prefix - self.loaded


def promised_prefix(present: Sequence[bool]) -> int:
    """The number of present columns from column 0."""
    for col, here in enumerate(present):
        if not here:
            return col
    return len(present)


def plan_lookup_window(present: Sequence[bool], l2_bytes: Sequence[int],
                       window_bytes: int) -> WindowPlan:
    """The lookup's load for a prefix whose columns need ``l2_bytes[c]`` from L2 (0: all in
    L1).  ``window_bytes <= 0`` streams nothing: the whole prefix is loaded (or fails) as LMCache
    would."""
    if len(present) != len(l2_bytes):
        raise ValueError("present and l2_bytes must have one entry per column")
    prefix = promised_prefix(present)
    if window_bytes <= 0:
        return WindowPlan(prefix, prefix)
    total = 0
    for col in range(prefix):
        total += l2_bytes[col]
        if total > window_bytes and col > 0:
            return WindowPlan(col, prefix)
    return WindowPlan(prefix, prefix)


def promised_hit(plan: WindowPlan | None, landed: int) -> int:
    """The hit to report for a lookup that planned ``plan`` and locked ``landed`` columns."""
    if plan is None or plan.deferred <= 0 or landed < plan.loaded:
        return landed
    return max(landed, plan.prefix)


@dataclass(frozen=True)
class Segment:
    """Columns ``[start, end)`` of a retrieve; ``locked``: the lookup already holds them."""

    start: int
    end: int
    locked: bool

    def __len__(self) -> int:
        return self.end - self.start


def retrieve_segments(start: int, locked_end: int, end: int, window_columns: int
                      ) -> list[Segment]:
    """The segments of a retrieve of columns ``[start, end)`` whose ``[0, locked_end)`` the
    lookup holds (see the module invariants)."""
    if window_columns < 1:
        raise ValueError("a window holds at least one column")
    if not 0 <= start <= end:
        raise ValueError(f"bad retrieve range [{start}, {end})")
    segments: list[Segment] = []
    if start < min(locked_end, end):
        segments.append(Segment(start, min(locked_end, end), True))
    col = max(start, locked_end)
    while col < end:
        nxt = min(col + window_columns, end)
        segments.append(Segment(col, nxt, False))
        col = nxt
    return segments


def window_columns(window_bytes: int, column_bytes: int) -> int:
    """Columns of ``column_bytes`` in one window (at least one)."""
    if column_bytes <= 0:
        raise ValueError("a column has a positive size")
    return max(1, window_bytes // column_bytes)


def pick_evictions(oldest_first: Iterable[tuple[_K, int]], need_bytes: int,
                   evictable: Callable[[_K], bool]) -> list[_K]:
    """Keys to evict, oldest first, until their sizes reach ``need_bytes``."""
    picked: list[_K] = []
    freed = 0
    if need_bytes <= 0:
        return picked
    for key, size in oldest_first:
        if not evictable(key):
            continue
        picked.append(key)
        freed += size
        if freed >= need_bytes:
            break
    return picked


@dataclass
class RestoreStats:
    """What the window did, for ``/metrics`` (monotonic counters; thread-safe)."""

    streamed_restores: int = 0
    streamed_columns: int = 0
    streamed_bytes: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    released_abandoned: int = 0
    stores_dropped: int = 0  # chunks of STOREs that L1 could not take, even after evicting
    stores_dropped_bytes: int = 0
    cut_short: dict[str, int] = field(default_factory=dict)
    cut_short_tokens: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def cut(self, reason: str, tokens: int) -> None:
        with self._lock:
            self.cut_short[reason] = self.cut_short.get(reason, 0) + 1
            self.cut_short_tokens[reason] = self.cut_short_tokens.get(reason, 0) + tokens

    def snapshot(self) -> dict[str, object]:
        """Every counter (the per-reason ones copied), as ``StoreStats.as_dict`` reads its."""
        with self._lock:  # the per-reason dicts are copied under the lock that guards them
            return {f.name: dict(v) if isinstance(v := getattr(self, f.name), dict) else v
                    for f in dataclasses.fields(self) if not f.name.startswith("_")}


class Bounded(OrderedDict[_K, _V]):
    """A dict of at most ``capacity`` entries: setting one past it drops the oldest set.  For
    records kept per prefetch or request that LMCache may never come back for (a lookup given
    up, a plan never consumed); every user treats a missing record as "no promise", so a
    dropped one costs at most a shorter hit, never a wrong one."""

    def __init__(self, capacity: int = SERVED_RECORDS) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: _K, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class ServedPrefixes:
    """Columns handed over by each (request id, worker instance) whose last retrieve failed
    (see the module invariants).  Thread-safe; at most ``capacity`` records."""

    def __init__(self, capacity: int = SERVED_RECORDS) -> None:
        self._records: Bounded[tuple[str, int], int] = Bounded(capacity)
        self._lock = threading.Lock()

    def clear(self, request_id: str, instance_id: int) -> None:
        with self._lock:
            self._records.pop((request_id, instance_id), None)

    def record(self, request_id: str, instance_id: int, served_columns: int) -> None:
        if served_columns < 0:
            raise ValueError(f"served_columns must be >= 0, got {served_columns}")
        with self._lock:
            self._records[(request_id, instance_id)] = served_columns

    def served(self, request_id: str, instance_id: int) -> int | None:
        with self._lock:
            return self._records.get((request_id, instance_id))


def served_blocks(block_ids: Sequence[int], served_columns: int,
                  blocks_per_column: int) -> list[int]:
    """The blocks of a single-group retrieve (``block_ids`` from its first column, in token
    order) that its first ``served_columns`` columns were handed over into; the rest were not."""
    if served_columns < 0 or blocks_per_column <= 0:
        raise ValueError("served_columns must be >= 0 and blocks_per_column > 0")
    return list(block_ids[:served_columns * blocks_per_column])
