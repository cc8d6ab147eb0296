"""L1 as a window, not a precondition: kvpersist's changes to LMCache 0.5.6's restore path.

LMCache's server restores a prefix only if all of it fits in *free* L1 at once: the prefetch
reserves each row's L1 buffers all or nothing, nothing is evicted to make room, and a row that
does not fit drops every L2 chunk of the hit.  This module, installed in the server by
:mod:`kvpersist.serving.lmcache_entry` before LMCache builds anything, changes that in four
places and nowhere else (the rules are :mod:`kvpersist.serving.restore_window`):

1. **Eviction on demand** (each L1 manager's ``reserve_write``): a reservation that runs out of
   memory evicts *clean* objects (ones an L2 adapter reported stored) that nobody holds, oldest
   first, and tries again; what still does not fit is reserved as the longest prefix of each
   row that fits (never all-or-nothing), so a restore gets the longest prefix L1 can take.
2. **A lookup window** (the prefetch controller's ``_plan_load``, for lookups of models whose
   engines registered in ``lmcache_driven`` mode): the lookup loads only the first window of the
   prefix from L2 and returns the rest of its L2 locks; the hit it reports
   (``LookupModule._consume_prefetch_result``) is the whole present prefix once that window
   landed.  The session records only what the lookup locked, so LMCache's own lock releases
   stay exact.
3. **A streamed retrieve** (``LMCacheDrivenTransferModule.retrieve``): the locked columns are
   handed over as LMCache would; the deferred ones are loaded window by window through
   LMCache's own prefetch (verified reads, L1 locks), each handed over with LMCache's own
   retrieve and released before the window after the next.  A window that does not load in full
   (a bad file, a deleted file) ends the retrieve as failed, never serving a hole; the chunks
   already handed over are recorded (``restore_window.SERVED_ROUTE``), so the worker's
   :mod:`kvpersist.serving.served_prefix` reports only the blocks from the failed chunk on and
   vLLM recomputes from there, not the whole prefix.
4. **An abandoned lookup is released** (``LookupModule.free_lookup_locks``): a prefetch still
   running when the connector gives its lookup up is settled in the background when it
   finishes, instead of holding its L1 buffers until the read-lock TTL (300 s).

``engine_driven`` retrieves hand the engine L1 buffers it copies itself, all in one reply, so
they cannot stream in this version: their lookups are never windowed and get the longest
prefix that fits (1.), with the shortfall logged and counted (``cut_short``).

:data:`FEATURE` (``l1_window`` in :mod:`.pins`) lists every LMCache function these hooks rely
on, pinned by source: when one changed, :func:`install` installs nothing, and the server keeps
LMCache's own restore path (the contract test fails first).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import restore_window as rules
from ..restore_window import RestoreStats, WindowPlan
from . import l1_internals, pins

FEATURE = "l1_window"

logger = logging.getLogger("kvpersist.l1_window")

#: How long a streamed window short of L1 is tried again while earlier windows are released.
WINDOW_RETRY_S = 30.0

#: How long a streamed window's load may take before the retrieve gives up (the worker's own
#: wait, ``kvpersist.lookup_max_s``, is the operator's ceiling; this only bounds a thread).
WINDOW_LOAD_MAX_S = 900.0


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


class L1Window:
    """The server's window state: one per server process (see the module docstring)."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.stats = RestoreStats()
        self.clean = CleanKeys()
        self.served = rules.ServedPrefixes()
        self.storage_manager: Any = None
        self._lock = threading.Lock()
        self._streamable: set[tuple[str, int]] = set()
        self._engine_driven: set[tuple[str, int]] = set()
        # Per lookup or prefetch, bounded: LMCache may never come back for one (a lookup given
        # up); a record missing is read as "no promise" (rules.Bounded).
        self._lookups: rules.Bounded[int, tuple[list[Any], tuple[str, int]]] = rules.Bounded()
        self._plans: rules.Bounded[int, WindowPlan] = rules.Bounded()
        # prefetch id -> (prefix, column bytes)
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

    # -- 1. eviction on demand
    def evict_clean(self, l1_manager: Any, need_bytes: int) -> int:
        """Evict clean, unheld objects, oldest first, for ``need_bytes``; the bytes freed."""
        oldest = l1_internals.lru_order(self.storage_manager, l1_manager)
        if oldest is None:  # not LMCache's LRU policy: no eviction on demand
            return 0
        objects = l1_internals.l1_objects(l1_manager)

        sizes: dict[Any, int] = {}

        def sized() -> Any:
            for key in oldest:
                entry = objects.get(key)
                if entry is not None:
                    sizes[key] = entry.memory_obj.get_size()
                    yield key, sizes[key]

        picked = rules.pick_evictions(
            sized(), need_bytes,
            lambda k: k in self.clean and l1_manager.is_key_evictable(k))
        if not picked:
            return 0
        results = l1_manager.delete(picked)
        freed_keys = [k for k, err in results.items() if err.name == "SUCCESS"]
        freed = int(sum(sizes.get(k, 0) for k in freed_keys))
        self.stats.add(evicted_objects=len(freed_keys), evicted_bytes=freed)
        return freed

    def reserve_write(self, l1_manager: Any, original: Callable[..., Any], keys: list[Any],
                      is_temporary: list[bool], layout_desc: Any, tag: str = "") -> Any:
        results = original(keys, is_temporary, layout_desc, tag)
        oom = [i for i, key in enumerate(keys) if results[key][0].name == "OUT_OF_MEMORY"]
        if not oom:
            return results
        need = len(oom) * layout_bytes(layout_desc)
        for _ in range(3):
            if self.evict_clean(l1_manager, need) <= 0:
                break
            retry = original([keys[i] for i in oom], [is_temporary[i] for i in oom],
                             layout_desc, tag)
            results.update(retry)
            oom = [i for i in oom if results[keys[i]][0].name == "OUT_OF_MEMORY"]
            if not oom:
                return results
            need = len(oom) * layout_bytes(layout_desc)
        # Whatever still does not fit: the longest prefix of the row that does, taken in
        # halving batches (each success is kept; a failed attempt frees what it allocated).
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
        request = getattr(self._local, "request", None)
        if request is not None and taken < len(oom):
            with self._lock:
                self._oom[request] = True
        return results

    # -- 2. the lookup window
    def remember_lookup(self, key_groups: list[Any], model: tuple[str, int]) -> None:
        with self._lock:
            self._lookups[id(key_groups)] = (key_groups, model)

    def plan_load(self, controller: Any, original: Callable[..., Any], request: Any,
                  active_l2_descs: Any) -> Any:
        with self._lock:
            lookup = self._lookups.pop(id(request.key_groups), None)
        if lookup is not None and lookup[0] is request.key_groups:
            self._window(controller, request, lookup[1])
        return original(request, active_l2_descs)

    def _window(self, controller: Any, request: Any, model: tuple[str, int]) -> None:
        groups = request.key_groups
        states = request.key_states
        num_cols = len(groups[0].keys)
        l1 = states.l1_locked_keys.merge() if len(list(states.l1_locked_keys.items())) else None
        l2 = states.l2_locked_keys.merge() if len(list(states.l2_locked_keys.items())) else None
        row_bytes = [layout_bytes(g.layout_desc) for g in groups]
        present, cost = [], []
        for col in range(num_cols):
            here, need = True, 0
            for row in range(len(groups)):
                in_l1 = l1 is not None and l1[row].test(col)
                in_l2 = l2 is not None and l2[row].test(col)
                here = here and (in_l1 or in_l2)
                need += row_bytes[row] if (in_l2 and not in_l1) else 0
            present.append(here)
            cost.append(need)
        windowed = (self.streams(model)
                    and all(g.sliding_window_size < 0 for g in groups))
        plan = rules.plan_lookup_window(present, cost, self.window_bytes if windowed else 0)
        with self._lock:
            self._present[request.request_id] = (plan.prefix, sum(row_bytes))
        if plan.deferred <= 0:
            return
        for l2_idx, grid in list(states.l2_locked_keys.items()):
            drop = grid.zeros_like()
            for row in range(len(groups)):
                for col in range(plan.loaded, num_cols):
                    if grid[row].test(col):
                        drop[row].set(col)
            keys = [groups[r].keys[c] for r in range(len(groups))
                    for c in drop[r].get_indices_list()]
            if keys:
                controller._l2_adapters[l2_idx].submit_unlock(keys)
                states.l2_locked_keys[l2_idx] = grid - drop
        with self._lock:
            self._plans[request.request_id] = plan

    def in_load_phase(self, request: Any) -> None:
        self._local.request = request.request_id

    def out_of_load_phase(self) -> None:
        self._local.request = None

    def hit(self, job: Any, landed: int, chunk_size: int) -> int:
        """The hit to report for a finished lookup (see ``restore_window.promised_hit``)."""
        pid = job.handle.prefetch_request_id
        with self._lock:
            plan = self._plans.pop(pid, None)
            prefix, column_bytes = self._present.pop(pid, (landed, 0))
            oom = self._oom.pop(pid, False)
        reported = rules.promised_hit(plan, landed)
        if plan is not None and reported > landed:
            with self._lock:
                self._locked[job.request_id] = landed
            self.stats.add(streamed_restores=1)
            logger.info("kvpersist: request %s: %d of %d chunks from the lookup window, %d "
                        "streamed through L1 at retrieve", job.request_id, landed, reported,
                        reported - landed)
        if reported < prefix:
            reason = "l1_full" if oom else "load_failed"
            lost = prefix - reported
            self.stats.cut(reason, lost * chunk_size)
            logger.warning("kvpersist: request %s: restore cut short (%s): %d of %d chunks, "
                           "%d tokens (%.1f MiB) recomputed", job.request_id, reason, reported,
                           prefix, lost * chunk_size, lost * column_bytes / 2**20)
        return reported

    def locked_columns(self, request_id: str) -> int | None:
        with self._lock:
            return self._locked.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._locked.pop(request_id, None)

    # -- 3. the streamed retrieve
    def retrieve(self, module: Any, original: Callable[..., Any], key: Any, instance_id: int,
                 gpu_block_ids: list[list[int]], event_ipc_handle: bytes,
                 skip_first_n_tokens: int) -> tuple[bytes, bool]:
        ctx = module._ctx
        chunk = ctx.chunk_size
        self.served.clear(key.request_id, instance_id)
        locked = self.locked_columns(key.request_id)
        streamed_part = not (locked is None or key.start % chunk or key.end % chunk
                             or key.end // chunk <= locked)
        entry = module.get_and_touch_context_entry(instance_id) if streamed_part else None
        if entry is None or locked is None:  # nothing deferred, or unregistered (rejected)
            unchanged: tuple[bytes, bool] = original(module, key, instance_id, gpu_block_ids,
                                                     event_ipc_handle, skip_first_n_tokens)
            return unchanged
        cache_context = entry.cache_context
        attn_desc = cache_context.kv_layer_groups_manager.get_attn_desc()
        if any(w >= 0 for w in attn_desc.num_chunks_in_sw) or "aux" in attn_desc.group_kinds:
            logger.error("kvpersist: request %s: a streamed restore needs full attention in "
                         "every group; failing it (vLLM recomputes)", key.request_id)
            return b"", False
        groups = list(range(cache_context.kv_layer_groups_manager.num_object_groups))
        layouts = ctx.layout_desc_registry.find_group_layout_descs(key.model_name,
                                                                   key.world_size)
        column_bytes = sum(layout_bytes(layouts[g]) for g in groups)
        per_window = rules.window_columns(self.window_bytes, column_bytes)
        first = key.start // chunk
        bpc = [cache_context.calculate_num_blocks(chunk, g)
               for g in range(cache_context.kv_layer_groups_manager.num_kernel_groups)]
        segments = rules.retrieve_segments(first, locked, key.end // chunk, per_window)
        pending: dict[int, Any] = {}

        def load(start: int, end: int) -> Any:
            sub = dataclasses.replace(key, start=start * chunk, end=end * chunk)
            hashes = ctx.token_hasher.compute_chunk_hashes(list(key.token_ids),
                                                           start=sub.start, end=sub.end)
            return self._submit_window(ctx, sub, hashes, groups, layouts, attn_desc)

        def hand_over(start: int, end: int) -> tuple[bytes, bool]:
            sub = dataclasses.replace(key, start=start * chunk, end=end * chunk)
            blocks = [ids[(start - first) * n:(end - first) * n]
                      for ids, n in zip(gpu_block_ids, bpc, strict=True)]
            result: tuple[bytes, bool] = original(
                module, sub, instance_id, blocks, event_ipc_handle,
                skip_first_n_tokens if start == first else 0)
            return result

        handle, ok, streamed, served = b"", True, 0, first
        deferred = [s for s in segments if not s.locked]
        for s in deferred[:rules.IN_FLIGHT_WINDOWS - 1]:
            pending[s.start] = load(s.start, s.end)
        next_load = rules.IN_FLIGHT_WINDOWS - 1
        for segment in segments:
            if segment.locked:
                handle, ok = hand_over(segment.start, segment.end)
                if not ok:
                    break
                served = segment.end
                continue
            window = pending.pop(segment.start)
            if next_load < len(deferred):
                nxt = deferred[next_load]
                pending[nxt.start] = load(nxt.start, nxt.end)
                next_load += 1
            col, retry_until = segment.start, time.monotonic() + WINDOW_RETRY_S
            while ok and col < segment.end:
                landed, short_of_l1 = self._wait_window(window, segment.end - col)
                if landed:
                    handle, ok = hand_over(col, col + landed)
                    if ok:
                        served = col + landed
                    col += landed
                    streamed += landed
                elif not short_of_l1 or time.monotonic() > retry_until:
                    ok = False  # a file that did not load or verify: never serve a hole
                if ok and col < segment.end:
                    # L1 was short (the previous window's buffers not yet released): again
                    if not landed:
                        time.sleep(0.05)
                    window = load(col, segment.end)
            if not ok:
                break
        for waiting in pending.values():  # windows loaded for a retrieve that stopped
            self._release_window(waiting)
        self.stats.add(streamed_columns=streamed, streamed_bytes=streamed * column_bytes)
        if not ok:
            # Recorded before the failed reply leaves, so the worker that asks finds it.
            self.served.record(key.request_id, instance_id, served - first)
            lost = key.end // chunk - served
            self.stats.cut("stream_failed", lost * chunk)
            logger.warning("kvpersist: request %s: streamed restore stopped at a window that did "
                           "not load in full; %d tokens served, %d recomputed", key.request_id,
                           (served - first) * chunk, lost * chunk)
        return handle, ok

    def _submit_window(self, ctx: Any, sub_key: Any, hashes: list[bytes], groups: list[int],
                       layouts: Any, attn_desc: Any) -> tuple[Any, list[Any]]:
        """Submit a window's load through LMCache's prefetch; (handle, its key rows)."""
        from lmcache.v1.distributed.api import (
            PrefetchTaskSpec,
            ipc_key_to_grouped_object_keys,
        )

        rows = ipc_key_to_grouped_object_keys(sub_key, hashes, groups, layouts, attn_desc)
        spec = PrefetchTaskSpec(key_groups=rows, num_kv_readers=1)
        handle = ctx.storage_manager.submit_prefetch_task(
            spec, external_request_id=f"{sub_key.request_id}/stream@{sub_key.start}")
        return handle, rows

    def _wait_window(self, window: tuple[Any, list[Any]], columns: int) -> tuple[int, bool]:
        """(columns of a window that landed in L1, locked once each, from its first; whether an
        L1 reservation of it ran out of memory).  The prefetch itself releases every lock
        outside its hit prefix."""
        handle, _rows = window
        sm = self.storage_manager
        deadline = time.monotonic() + WINDOW_LOAD_MAX_S
        while not sm.wait_prefetch_status(handle, 1.0):
            if time.monotonic() > deadline:
                logger.error("kvpersist: a streamed window did not load in %.0f s",
                             WINDOW_LOAD_MAX_S)
                return 0, False
        result = sm.query_prefetch_status(handle)
        with self._lock:
            short = self._oom.pop(handle.prefetch_request_id, False)
        if result is None or not result.hit_cells:
            return 0, short
        landed = 0
        while landed < columns and all(row.test(landed) for row in result.hit_cells):
            landed += 1
        return landed, short

    def _release_window(self, window: tuple[Any, list[Any]]) -> None:
        """Return the locks of a window loaded for a retrieve that stopped before it."""
        handle, rows = window
        sm = self.storage_manager
        if not sm.wait_prefetch_status(handle, WINDOW_LOAD_MAX_S):
            return
        result = sm.query_prefetch_status(handle)
        if result is None:
            return
        keys = [row.keys[col] for row, hit in zip(rows, result.hit_cells, strict=True)
                for col in hit.get_indices_list()]
        if keys:
            sm.finish_read_prefetched(keys, read_locks=1)

    # -- 4. abandoned lookups
    def release_when_done(self, module: Any, original: Callable[..., Any], key: Any,
                          tp_size: int) -> None:
        """``free_lookup_locks`` for a lookup whose prefetch still runs: settled by a thread
        when the prefetch publishes its result."""
        with module._prefetch_job_lock:
            job = module._prefetch_jobs.get(key.request_id)
        sm = module._ctx.storage_manager
        if job is None or sm.wait_prefetch_status(job.handle, 0):
            original(module, key, tp_size)
            return

        def settle() -> None:
            if sm.wait_prefetch_status(job.handle, WINDOW_LOAD_MAX_S):
                original(module, key, tp_size)
                self.forget(key.request_id)
                self.stats.add(released_abandoned=1)
                logger.info("kvpersist: request %s: the abandoned lookup's L1 buffers were "
                            "released when its load finished", key.request_id)

        threading.Thread(target=settle, name=f"kvp-release-{key.request_id}",
                         daemon=True).start()


def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)  # keeps LMCache's handler attributes
    setattr(cls, name, wrapper)


def install(window_bytes: int) -> L1Window | None:
    """Install the hooks in this (server) process; returns the window state, or None (nothing
    installed, one line logged) when LMCache's pinned functions changed."""
    if not pins.available(FEATURE):
        return None
    from lmcache.v1.distributed import storage_manager as sm_mod
    from lmcache.v1.multiprocess.modules import engine_driven_transfer as ed
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ld
    from lmcache.v1.multiprocess.modules import lookup as lk

    window = L1Window(window_bytes)
    _log_to_stderr()
    _wrap(sm_mod.StorageManager, "__init__", lambda orig: _attaching(orig, window))
    _wrap(lk.LookupModule, "lookup", lambda orig: _remembering_lookups(orig, window))
    _wrap(lk.LookupModule, "_consume_prefetch_result",
          lambda orig: _reporting_promise(orig, window))
    _wrap(lk.LookupModule, "free_lookup_locks",
          lambda orig: (lambda self, key, tp_size: window.release_when_done(
              self, orig, key, tp_size)))
    _wrap(lk.LookupModule, "end_session", lambda orig: _forgetting(orig, window))
    _wrap(ld.LMCacheDrivenTransferModule, "retrieve",
          lambda orig: (lambda self, key, instance_id, gpu_block_ids, event_ipc_handle,
                        skip_first_n_tokens=0: window.retrieve(
                            self, orig, key, instance_id, gpu_block_ids, event_ipc_handle,
                            skip_first_n_tokens)))
    _wrap(ld.LMCacheDrivenTransferModule, "register_kv_cache",
          lambda orig: _registering(orig, window))
    _wrap(ed.EngineDrivenTransferModule, "register_kv_cache_engine_driven_context",
          lambda orig: _registering_engine_driven(orig, window))
    from .. import restore_metrics

    restore_metrics.bind(window.stats.snapshot)
    from lmcache.v1.multiprocess import http_server

    _add_served_route(window, http_server.app)
    return window


def _add_served_route(window: L1Window, app: Any) -> None:
    """``GET restore_window.SERVED_ROUTE`` on the server's admin HTTP: what the failed
    retrieve of a (request, worker instance) handed over (404 when its last did not fail)."""
    from fastapi.responses import JSONResponse

    def served_prefix(request_id: str, instance_id: int) -> JSONResponse:
        served = window.served.served(request_id, instance_id)
        if served is None:
            return JSONResponse({"error": f"no failed retrieve of request {request_id!r} by "
                                          f"instance {instance_id} is recorded"},
                                status_code=404)
        return JSONResponse({"request_id": request_id, "instance_id": instance_id,
                             "served_chunks": served})

    app.add_api_route(rules.SERVED_ROUTE, served_prefix, methods=["GET"])


def _log_to_stderr() -> None:
    """kvpersist's server-side log lines go to the server's stderr (its log file), at INFO."""
    root = logging.getLogger("kvpersist")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] kvpersist %(levelname)s: "
                                               "%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _attaching(original: Callable[..., Any], window: L1Window) -> Callable[..., Any]:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        window.storage_manager = self
        self.register_l2_listener(window.clean)
        for manager in self._l1_managers_by_id.values():
            reserve = manager.reserve_write
            manager.reserve_write = functools.partial(window.reserve_write, manager, reserve)
        controller = self._prefetch_controller
        plan = controller._plan_load
        controller._plan_load = functools.partial(window.plan_load, controller, plan)
        transition = controller._transition_to_load_phase

        def load_phase(request: Any) -> None:
            window.in_load_phase(request)
            try:
                transition(request)
            finally:
                window.out_of_load_phase()

        controller._transition_to_load_phase = load_phase
        submit = self.submit_prefetch_task

        def submitting(spec: Any, external_request_id: str = "", skip_l2: bool = False) -> Any:
            model = getattr(window._local, "lookup_model", None)
            if model is not None:
                window.remember_lookup(spec.key_groups, model)
            return submit(spec, external_request_id=external_request_id, skip_l2=skip_l2)

        self.submit_prefetch_task = submitting
        logger.info("kvpersist: L1 window installed (%.3f GiB per streamed window%s)",
                    window.window_bytes / 2**30,
                    "" if window.window_bytes > 0 else ": streaming off")

    return init


def _remembering_lookups(original: Callable[..., Any], window: L1Window) -> Callable[..., Any]:
    def lookup(self: Any, key: Any, tp_size: int) -> None:
        window._local.lookup_model = (key.model_name, key.world_size)
        try:
            original(self, key, tp_size)
        finally:
            window._local.lookup_model = None

    return lookup


def _reporting_promise(original: Callable[..., Any], window: L1Window) -> Callable[..., Any]:
    def consume(self: Any, job: Any) -> int | None:
        landed = original(self, job)
        if landed is None:
            return None
        return window.hit(job, int(landed), self._ctx.chunk_size)

    return consume


def _registering_engine_driven(original: Callable[..., Any], window: L1Window
                               ) -> Callable[..., Any]:
    def register(self: Any, payload: Any) -> Any:
        window.registered(payload.model_name, payload.world_size, engine_driven=True)
        return original(self, payload)

    return register


def _forgetting(original: Callable[..., Any], window: L1Window) -> Callable[..., Any]:
    def end_session(self: Any, request_id: str) -> None:
        window.forget(request_id)
        original(self, request_id)

    return end_session


def _registering(original: Callable[..., Any], window: L1Window) -> Callable[..., Any]:
    def register(self: Any, instance_id: int, kv_caches: Any, model_name: str,
                 world_size: int, *args: Any, **kwargs: Any) -> Any:
        window.registered(model_name, world_size, engine_driven=False)
        return original(self, instance_id, kv_caches, model_name, world_size, *args, **kwargs)

    return register
