"""Which files an explicit cleanup would remove, in which order, down to a target.

Invariants
----------
* Deterministic: the same inventory and inputs give the same plan (ties break on the path).
* Order of classes: (1) temp leftovers, then quarantine; (2) inactive namespaces, the one with the
  oldest last access first, each removed whole; (3) the oldest files of active namespaces that
  exceed their quota, down to the quota; (4) the LRU tail (oldest first) of the active namespaces.
* With a target, the plan stops as soon as the remaining cache bytes are at or below it; class 4
  is only ever used with a target.  Without a target, classes 1–3 are planned in full.
* Only ``temp``, ``quarantine`` and ``live`` files are ever planned; ``unparsable`` files only
  when asked; ``foreign`` files and anything outside the root never.
* Temp files younger than ``min_temp_age_s`` are skipped: they may be a store in progress.
* A plan is rows of its inventory (numpy arrays), so planning a million files makes no Python
  object per file; :attr:`CleanupPlan.items` builds them on demand (for ``--apply`` and ``--json``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from ..l2.inventory import FOREIGN, LIVE, QUARANTINE, TEMP, UNPARSABLE, CacheFile, Inventory

CLASS_ORDER = ("temp", "quarantine", "unparsable", "inactive", "over-quota", "lru-active")
_REASON = {r: k for k, r in enumerate(CLASS_ORDER)}

Rows = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PlanItem:
    file: CacheFile
    reason: str  # one of CLASS_ORDER


@dataclass
class CleanupPlan:
    """``rows[k]`` (a row of ``inventory``) is removed k-th, for ``CLASS_ORDER[reasons[k]]``."""

    inventory: Inventory
    rows: Rows
    reasons: npt.NDArray[np.uint8]
    start_bytes: int
    target_bytes: int | None
    skipped_young_temp: int = 0
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.rows.size)

    @cached_property
    def items(self) -> list[PlanItem]:
        inv = self.inventory
        return [PlanItem(inv.file(r), CLASS_ORDER[c])
                for r, c in zip(self.rows.tolist(), self.reasons.tolist(), strict=True)]

    @property
    def planned_bytes(self) -> int:
        return int(self.inventory.size[self.rows].sum())

    @property
    def end_bytes(self) -> int:
        return self.start_bytes - self.planned_bytes

    def bytes_by_reason(self) -> dict[str, tuple[int, int]]:
        counts = np.bincount(self.reasons, minlength=len(CLASS_ORDER))
        sizes = np.zeros(len(CLASS_ORDER), np.int64)
        np.add.at(sizes, self.reasons, self.inventory.size[self.rows])
        return {r: (int(counts[k]), int(sizes[k])) for k, r in enumerate(CLASS_ORDER) if counts[k]}


def oldest_first(inv: Inventory, rows: Rows, groups: npt.NDArray[np.int32] | None = None) -> Rows:
    """``rows`` sorted by (group, mtime, directory, name): oldest first within each group, ties
    broken on the path so that the order never depends on the walk.  Only the rows that tie on
    (group, mtime) are compared by path (in Python)."""
    if rows.size < 2:
        return rows
    mtime = inv.mtime_ns[rows]
    order = np.lexsort((mtime,) if groups is None else (mtime, groups))
    rows, mtime = rows[order], mtime[order]
    same = mtime[1:] == mtime[:-1]
    if groups is not None:
        groups = groups[order]
        same &= groups[1:] == groups[:-1]
    if not same.any():
        return rows
    tied = np.zeros(rows.size, bool)
    tied[1:] |= same
    tied[:-1] |= same
    where = np.flatnonzero(tied)
    paths = [(inv.dirs[inv.dir_idx[r]], inv.name(int(r))) for r in rows[where]]
    rank = np.zeros(rows.size, np.int64)
    rank[where[sorted(range(len(paths)), key=paths.__getitem__)]] = np.arange(1, len(paths) + 1)
    ordered: Rows = rows[np.lexsort((rank, mtime) if groups is None else (rank, mtime, groups))]
    return ordered


def plan_cleanup(
    inventory: Inventory,
    *,
    active: set[str],
    quotas: Mapping[str, int] | None = None,
    target_bytes: int | None = None,
    only_namespaces: set[str] | None = None,
    include_unparsable: bool = False,
    min_temp_age_s: float = 300.0,
    now: float | None = None,
) -> CleanupPlan:
    inv = inventory
    now = time.time() if now is None else now
    quotas = quotas or {}
    start = inv.cache_bytes + (int(inv.size[inv.cls == UNPARSABLE].sum()) if include_unparsable else 0)
    parts: list[tuple[Rows, str]] = []

    temps = inv.of_class(TEMP)
    old_temps = temps[inv.mtime_ns[temps] <= int((now - min_temp_age_s) * 1e9)]
    skipped_young = int(temps.size - old_temps.size)
    if only_namespaces is None:
        parts.append((oldest_first(inv, old_temps), "temp"))
        parts.append((oldest_first(inv, inv.of_class(QUARANTINE)), "quarantine"))
        if include_unparsable:
            parts.append((oldest_first(inv, inv.of_class(UNPARSABLE)), "unparsable"))

    # Live rows grouped by namespace, oldest first within each.
    ns_names, ns_of_model = inv.namespace_index()
    live = inv.of_class(LIVE)
    if only_namespaces is not None:
        keep = np.array([ns in only_namespaces for ns in ns_names], bool)
        live = live[keep[ns_of_model[inv.model_idx[live]]]]
    live = oldest_first(inv, live, ns_of_model[inv.model_idx[live]])
    group = ns_of_model[inv.model_idx[live]]
    bounds = np.searchsorted(group, np.arange(len(ns_names) + 1))
    runs = {ns_names[g]: live[bounds[g]:bounds[g + 1]] for g in range(len(ns_names))
            if bounds[g + 1] > bounds[g]}

    inactive = sorted((ns for ns in runs if ns not in active),
                      key=lambda ns: (int(inv.mtime_ns[runs[ns][-1]]), ns))
    for ns in inactive:
        parts.append((runs[ns], "inactive"))

    tails: list[Rows] = []
    for ns in sorted(n for n in runs if n in active):
        rows = runs[ns]
        excess = int(inv.size[rows].sum()) - quotas.get(ns, 1 << 62)
        chosen = 0
        if excess > 0:
            chosen = int(np.searchsorted(np.cumsum(inv.size[rows]), excess)) + 1
            parts.append((rows[:chosen], "over-quota"))
        tails.append(rows[chosen:])

    notes: list[str] = []
    if target_bytes is not None and tails:
        parts.append((oldest_first(inv, np.concatenate(tails)), "lru-active"))

    rows = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, np.int64)
    reasons = np.concatenate([np.full(p.size, _REASON[r], np.uint8) for p, r in parts]) \
        if parts else np.zeros(0, np.uint8)
    if target_bytes is not None:
        sizes = inv.size[rows]
        before = start - (np.cumsum(sizes) - sizes)  # bytes left before each row is removed
        n = int(np.count_nonzero(before > target_bytes))  # a prefix: `before` never grows
        rows, reasons = rows[:n], reasons[:n]
        if start - int(sizes[:n].sum()) > target_bytes:
            notes.append("the target cannot be reached with what may be removed")
    assert not (inv.cls[rows] == FOREIGN).any(), "foreign files are never planned"
    return CleanupPlan(inv, rows.astype(np.int64), reasons, start, target_bytes, skipped_young, notes)
