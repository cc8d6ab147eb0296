"""The L1 window's state in one server process: what the four changes share.

Invariants
----------
* One :class:`WindowState` per server process, created by :func:`.install.install`; every
  record keyed by a lookup, prefetch or request is :class:`~kvpersist.serving.restore_window.
  Bounded`, because LMCache may never come back for one (a lookup given up): a missing record
  reads as "no promise", never as a hit.
* Every record is read and written under the state's lock; the per-thread request marker
  (``in_load_phase``) is thread-local, as LMCache's prefetch controller runs one load phase per
  call on its own thread.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from ... import restore_window as rules
from ...restore_window import RestoreStats, WindowPlan


def layout_bytes(layout_desc: Any) -> int:
    """Bytes of one object of ``layout_desc`` (LMCache's ``MemoryLayoutDesc``)."""
    return sum(math.prod(shape) * dtype.itemsize
               for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True))


class CleanKeys:
    """Keys an L2 adapter reported stored (and not deleted since): evicting them from L1 loses
    nothing.  An LMCache ``L2AdapterListener``."""

    def __init__(self) -> None:
        self._keys: set[Any] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        with self._lock:
            self._keys.update(keys)

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        return None

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        with self._lock:
            self._keys.difference_update(keys)


class WindowState:
    """The window's records (see the module docstring)."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.stats = RestoreStats()
        self.clean = CleanKeys()
        self.served = rules.ServedPrefixes()
        self.storage_manager: Any = None
        self._lock = threading.Lock()
        self._streamable: set[tuple[str, int]] = set()
        self._engine_driven: set[tuple[str, int]] = set()
        # id(key groups) of a lookup's prefetch -> (its key groups, the model it looks up)
        self._lookups: rules.Bounded[int, tuple[list[Any], tuple[str, int]]] = rules.Bounded()
        self._plans: rules.Bounded[int, WindowPlan] = rules.Bounded()
        # prefetch id -> (present prefix in columns, bytes of one column)
        self._present: rules.Bounded[int, tuple[int, int]] = rules.Bounded()
        self._oom: rules.Bounded[int, bool] = rules.Bounded()  # prefetches short of L1
        # request id -> columns its lookup locked (streamed)
        self._locked: rules.Bounded[str, int] = rules.Bounded()
        self._local = threading.local()

    # -- registration: which models can stream
    def registered(self, model_name: str, world_size: int, engine_driven: bool) -> None:
        with self._lock:
            (self._engine_driven if engine_driven else self._streamable).add(
                (model_name, world_size))

    def streams(self, model: tuple[str, int]) -> bool:
        with self._lock:
            return (self.window_bytes > 0 and model in self._streamable
                    and model not in self._engine_driven)

    # -- the lookup being served on this thread, and the prefetch it submits
    @property
    def lookup_model(self) -> tuple[str, int] | None:
        model: tuple[str, int] | None = getattr(self._local, "lookup_model", None)
        return model

    @lookup_model.setter
    def lookup_model(self, model: tuple[str, int] | None) -> None:
        self._local.lookup_model = model

    def remember_lookup(self, key_groups: list[Any], model: tuple[str, int]) -> None:
        with self._lock:
            self._lookups[id(key_groups)] = (key_groups, model)

    def take_lookup(self, key_groups: list[Any]) -> tuple[str, int] | None:
        """The model of the lookup whose prefetch carries ``key_groups`` (once), else None."""
        with self._lock:
            lookup = self._lookups.pop(id(key_groups), None)
        return lookup[1] if lookup is not None and lookup[0] is key_groups else None

    # -- the load phase in progress on this thread (for reservations short of L1)
    def in_load_phase(self, prefetch_id: int | None) -> None:
        self._local.request = prefetch_id

    def loading(self) -> bool:
        """Whether this thread is in a load phase (else its reservations are a STORE's)."""
        return getattr(self._local, "request", None) is not None

    def short_of_l1(self) -> None:
        """A reservation of the load phase on this thread ran out of L1."""
        prefetch_id = getattr(self._local, "request", None)
        if prefetch_id is not None:
            with self._lock:
                self._oom[prefetch_id] = True

    def take_short_of_l1(self, prefetch_id: int) -> bool:
        with self._lock:
            return self._oom.pop(prefetch_id, False)

    # -- a lookup's plan, from the window to the hit it reports
    def planned(self, prefetch_id: int, present: tuple[int, int],
                plan: WindowPlan | None) -> None:
        with self._lock:
            self._present[prefetch_id] = present
            if plan is not None:
                self._plans[prefetch_id] = plan

    def take_plan(self, prefetch_id: int, landed: int
                  ) -> tuple[WindowPlan | None, tuple[int, int], bool]:
        """(the plan, (present prefix, column bytes), whether L1 ran short) of a prefetch."""
        with self._lock:
            return (self._plans.pop(prefetch_id, None),
                    self._present.pop(prefetch_id, (landed, 0)),
                    self._oom.pop(prefetch_id, False))

    # -- what a streamed request's lookup locked, until its session ends
    def lock_columns(self, request_id: str, columns: int) -> None:
        with self._lock:
            self._locked[request_id] = columns

    def locked_columns(self, request_id: str) -> int | None:
        with self._lock:
            return self._locked.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._locked.pop(request_id, None)
