"""1. Eviction on demand: an L1 reservation that runs out of memory evicts clean objects.

Invariants
----------
* Only *clean* objects (an L2 adapter reported them stored, :class:`.state.CleanKeys`) that
  nobody holds (LMCache's ``is_key_evictable``) are evicted, oldest first in LMCache's own LRU
  order: eviction loses nothing that is not on L2.
* A reservation that still does not fit after three rounds of eviction is reserved as the
  longest prefix of its row that fits, never all-or-nothing; the load phase it belongs to is
  marked short of L1 (the hit's shortfall is then reported as ``l1_full``).  Outside a load
  phase the reservation is a STORE's: what did not fit is counted as dropped
  (``stores_dropped``), since LMCache skips it silently and the engine is told it was stored.
* Without LMCache's LRU policy (:func:`..l1_internals.lru_order` is None) nothing is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ... import restore_window as rules
from .. import l1_internals
from .state import WindowState, layout_bytes

#: Rounds of "evict, then reserve again" before the longest prefix that fits is taken.
EVICTION_ROUNDS = 3


def evict_clean(state: WindowState, l1_manager: Any, need_bytes: int) -> int:
    """Evict clean, unheld objects, oldest first, for ``need_bytes``; the bytes freed."""
    oldest = l1_internals.lru_order(state.storage_manager, l1_manager)
    if oldest is None:  # not LMCache's LRU policy: no eviction on demand
        return 0
    objects = l1_internals.l1_objects(l1_manager)
    sizes: dict[Any, int] = {}

    def sized() -> Iterator[tuple[Any, int]]:
        for key in oldest:
            entry = objects.get(key)
            if entry is not None:
                sizes[key] = entry.memory_obj.get_size()
                yield key, sizes[key]

    picked = rules.pick_evictions(
        sized(), need_bytes, lambda k: k in state.clean and l1_manager.is_key_evictable(k))
    if not picked:
        return 0
    results = l1_manager.delete(picked)
    freed_keys = [k for k, err in results.items() if err.name == "SUCCESS"]
    freed = int(sum(sizes.get(k, 0) for k in freed_keys))
    state.stats.add(evicted_objects=len(freed_keys), evicted_bytes=freed)
    return freed


def reserve_write(state: WindowState, l1_manager: Any, original: Callable[..., Any],
                  keys: list[Any], is_temporary: list[bool], layout_desc: Any,
                  tag: str = "") -> Any:
    """LMCache's ``L1Manager.reserve_write`` (``original``), evicting on demand."""
    results = original(keys, is_temporary, layout_desc, tag)
    oom = [i for i, key in enumerate(keys) if results[key][0].name == "OUT_OF_MEMORY"]
    if not oom:
        return results
    need = len(oom) * layout_bytes(layout_desc)
    for _ in range(EVICTION_ROUNDS):
        if evict_clean(state, l1_manager, need) <= 0:
            break
        retry = original([keys[i] for i in oom], [is_temporary[i] for i in oom],
                         layout_desc, tag)
        results.update(retry)
        oom = [i for i in oom if results[keys[i]][0].name == "OUT_OF_MEMORY"]
        if not oom:
            return results
        need = len(oom) * layout_bytes(layout_desc)
    # Whatever still does not fit: the longest prefix of the row that does, taken in halving
    # batches (each success is kept; a failed attempt frees what it allocated).
    taken, batch = 0, max(1, len(oom) // 2)
    while taken < len(oom) and batch > 0:
        part = oom[taken:taken + batch]
        attempt = original([keys[i] for i in part], [is_temporary[i] for i in part],
                           layout_desc, tag)
        if all(attempt[keys[i]][0].name == "SUCCESS" for i in part):
            results.update(attempt)
            taken += len(part)
        else:
            batch //= 2
    if taken < len(oom):
        if state.loading():
            state.short_of_l1()
        else:  # a STORE: LMCache skips what it could not reserve and answers success
            dropped = len(oom) - taken
            state.stats.add(stores_dropped=dropped,
                            stores_dropped_bytes=dropped * layout_bytes(layout_desc))
    return results
