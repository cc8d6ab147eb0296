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
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .inventory import CacheFile, Inventory

CLASS_ORDER = ("temp", "quarantine", "unparsable", "inactive", "over-quota", "lru-active")


@dataclass(frozen=True)
class PlanItem:
    file: CacheFile
    reason: str  # one of CLASS_ORDER


@dataclass
class CleanupPlan:
    items: list[PlanItem]
    start_bytes: int
    target_bytes: int | None
    skipped_young_temp: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def planned_bytes(self) -> int:
        return sum(i.file.size for i in self.items)

    @property
    def end_bytes(self) -> int:
        return self.start_bytes - self.planned_bytes

    def bytes_by_reason(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for item in self.items:
            n, b = out.get(item.reason, (0, 0))
            out[item.reason] = (n + 1, b + item.file.size)
        return {r: out[r] for r in CLASS_ORDER if r in out}


def _oldest_first(files: Iterable[CacheFile]) -> list[CacheFile]:
    return sorted(files, key=lambda f: (f.mtime, f.dir, f.name))


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
    now = time.time() if now is None else now
    quotas = quotas or {}
    start = inventory.cache_bytes + (
        sum(f.size for f in inventory.files if f.cls == "unparsable") if include_unparsable else 0)
    plan = CleanupPlan([], start, target_bytes)
    remaining = start

    def done() -> bool:
        return target_bytes is not None and remaining <= target_bytes

    def take(files: Iterable[CacheFile], reason: str) -> None:
        nonlocal remaining
        for f in files:
            if done():
                return
            plan.items.append(PlanItem(f, reason))
            remaining -= f.size

    def selected(ns: str) -> bool:
        return only_namespaces is None or ns in only_namespaces

    temps = [f for f in inventory.files if f.cls == "temp"]
    old_temps = [f for f in temps if now - f.mtime >= min_temp_age_s]
    plan.skipped_young_temp = len(temps) - len(old_temps)
    if only_namespaces is None:
        take(_oldest_first(old_temps), "temp")
        take(_oldest_first(f for f in inventory.files if f.cls == "quarantine"), "quarantine")
        if include_unparsable:
            take(_oldest_first(f for f in inventory.files if f.cls == "unparsable"), "unparsable")

    live = [f for f in inventory.files if f.cls == "live" and selected(f.namespace)]
    by_ns: dict[str, list[CacheFile]] = {}
    for f in live:
        by_ns.setdefault(f.namespace, []).append(f)
    inactive = sorted((ns for ns in by_ns if ns not in active),
                      key=lambda ns: (max(f.mtime for f in by_ns[ns]), ns))
    for ns in inactive:
        take(_oldest_first(by_ns[ns]), "inactive")

    for ns in sorted(n for n in by_ns if n in active and n in quotas):
        excess = sum(f.size for f in by_ns[ns]) - quotas[ns]
        if excess <= 0:
            continue
        chosen: list[CacheFile] = []
        for f in _oldest_first(by_ns[ns]):
            if excess <= 0:
                break
            chosen.append(f)
            excess -= f.size
        take(chosen, "over-quota")

    if target_bytes is not None:
        planned = {id(i.file) for i in plan.items}
        tail = [f for ns in by_ns if ns in active for f in by_ns[ns] if id(f) not in planned]
        take(_oldest_first(tail), "lru-active")
        if not done():
            plan.notes.append("the target cannot be reached with what may be removed")
    return plan
