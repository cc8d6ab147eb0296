"""2. The lookup window: a lookup loads only the first window of the prefix from L2.

Invariants
----------
* Only lookups of models whose engines registered in ``lmcache_driven`` mode, with full
  attention in every group, are windowed (:meth:`.state.WindowState.streams`); the others
  keep LMCache's plan and get the longest prefix L1 takes.
* A windowed lookup keeps its L2 locks on the window's columns only and returns the rest to
  the adapters before LMCache plans the load; the session records only what the lookup
  locked, so LMCache's own lock releases stay exact.
* The hit reported for a windowed lookup (:func:`reported_hit`) is the whole present prefix
  once the window landed (:func:`kvpersist.serving.restore_window.promised_hit`); a shortfall
  against the present prefix is logged and counted with its reason (``l1_full`` when a
  reservation ran short, else ``load_failed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ... import restore_window as rules
from .state import WindowState, layout_bytes

logger = logging.getLogger("kvpersist.l1_window")


def plan_load(state: WindowState, controller: Any, original: Callable[..., Any],
              request: Any, active_l2_descs: Any) -> Any:
    """LMCache's prefetch controller ``_plan_load`` (``original``), after the window is cut."""
    model = state.take_lookup(request.key_groups)
    if model is not None:
        _cut_window(state, controller, request, model)
    return original(request, active_l2_descs)


def _present_columns(request: Any) -> tuple[list[bool], list[int], list[int]]:
    """Per column: whether every row is in L1 or L2, and the bytes L2 must load for it; and
    the bytes of one object per row."""
    groups = request.key_groups
    states = request.key_states
    l1 = states.l1_locked_keys.merge() if len(list(states.l1_locked_keys.items())) else None
    l2 = states.l2_locked_keys.merge() if len(list(states.l2_locked_keys.items())) else None
    row_bytes = [layout_bytes(g.layout_desc) for g in groups]
    present, cost = [], []
    for col in range(len(groups[0].keys)):
        here, need = True, 0
        for row in range(len(groups)):
            in_l1 = l1 is not None and l1[row].test(col)
            in_l2 = l2 is not None and l2[row].test(col)
            here = here and (in_l1 or in_l2)
            need += row_bytes[row] if (in_l2 and not in_l1) else 0
        present.append(here)
        cost.append(need)
    return present, cost, row_bytes


def _cut_window(state: WindowState, controller: Any, request: Any,
                model: tuple[str, int]) -> None:
    groups = request.key_groups
    present, cost, row_bytes = _present_columns(request)
    windowed = state.streams(model) and all(g.sliding_window_size < 0 for g in groups)
    plan = rules.plan_lookup_window(present, cost, state.window_bytes if windowed else 0)
    deferred = plan.deferred > 0
    state.planned(request.request_id, (plan.prefix, sum(row_bytes)), plan if deferred else None)
    if not deferred:
        return
    l2_locked = request.key_states.l2_locked_keys
    for l2_idx, grid in list(l2_locked.items()):
        drop = grid.zeros_like()
        for row in range(len(groups)):
            for col in range(plan.loaded, len(groups[0].keys)):
                if grid[row].test(col):
                    drop[row].set(col)
        keys = [groups[r].keys[c] for r in range(len(groups))
                for c in drop[r].get_indices_list()]
        if keys:
            controller._l2_adapters[l2_idx].submit_unlock(keys)
            l2_locked[l2_idx] = grid - drop


def reported_hit(state: WindowState, job: Any, landed: int, chunk_size: int) -> int:
    """The hit to report for a finished lookup (see ``restore_window.promised_hit``)."""
    plan, (prefix, column_bytes), oom = state.take_plan(job.handle.prefetch_request_id, landed)
    reported = rules.promised_hit(plan, landed)
    if plan is not None and reported > landed:
        state.lock_columns(job.request_id, landed)
        state.stats.add(streamed_restores=1)
        logger.info("kvpersist: request %s: %d of %d chunks from the lookup window, %d "
                    "streamed through L1 at retrieve", job.request_id, landed, reported,
                    reported - landed)
    if reported < prefix:
        reason = "l1_full" if oom else "load_failed"
        lost = prefix - reported
        state.stats.cut(reason, lost * chunk_size)
        logger.warning("kvpersist: request %s: restore cut short (%s): %d of %d chunks, "
                       "%d tokens (%.1f MiB) recomputed", job.request_id, reason, reported,
                       prefix, lost * chunk_size, lost * column_bytes / 2**20)
    return reported
