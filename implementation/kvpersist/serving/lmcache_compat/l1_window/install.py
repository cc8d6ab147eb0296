"""The L1 window's replacements, installed in the server process before LMCache builds anything.

Invariants
----------
* :func:`install` replaces exactly the LMCache methods listed in feature ``l1_window`` of
  :mod:`..pins`, each wrapped (``functools.update_wrapper`` keeps LMCache's handler attributes)
  and calling LMCache's own method; when any pinned source changed it replaces nothing, logs
  one line and returns None, and the server keeps LMCache's own restore path.
* Per storage manager (one per server), its L1 managers' ``reserve_write`` evict on demand, its
  prefetch controller's ``_plan_load`` cuts the lookup window, and the load phase marks its
  thread, all bound to the one :class:`.state.WindowState`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .. import pins
from ..wrapping import wrap_method
from . import eviction, lookup_window, streamed_retrieve
from .abandoned import AbandonedLookups, release_when_done
from .route import add_served_route
from .state import WindowState

FEATURE = "l1_window"

logger = logging.getLogger("kvpersist.l1_window")


def install(window_bytes: int) -> WindowState | None:
    """Install the hooks in this (server) process; returns the window state, or None (nothing
    installed, one line logged) when LMCache's pinned functions changed."""
    if not pins.available(FEATURE):
        return None
    from lmcache.v1.distributed import storage_manager as sm_mod
    from lmcache.v1.multiprocess.modules import engine_driven_transfer as ed
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ld
    from lmcache.v1.multiprocess.modules import lookup as lk

    state = WindowState(window_bytes)
    abandoned = AbandonedLookups()
    _log_to_stderr()
    wrap_method(sm_mod.StorageManager, "__init__", lambda orig: _attaching(orig, state))
    wrap_method(lk.LookupModule, "lookup", lambda orig: _remembering_lookups(orig, state))
    wrap_method(lk.LookupModule, "_consume_prefetch_result",
          lambda orig: _reporting_promise(orig, state))
    wrap_method(lk.LookupModule, "free_lookup_locks",
          lambda orig: _releasing(orig, state, abandoned))
    wrap_method(lk.LookupModule, "end_session", lambda orig: _forgetting(orig, state))
    wrap_method(ld.LMCacheDrivenTransferModule, "retrieve", lambda orig: _streaming(orig, state))
    wrap_method(ld.LMCacheDrivenTransferModule, "register_kv_cache",
          lambda orig: _registering(orig, state))
    wrap_method(ed.EngineDrivenTransferModule, "register_kv_cache_engine_driven_context",
          lambda orig: _registering_engine_driven(orig, state))
    from lmcache.v1.multiprocess import http_server

    add_served_route(state, http_server.app)
    return state


def _log_to_stderr() -> None:
    """kvpersist's server-side log lines go to the server's stderr (its log file), at INFO."""
    root = logging.getLogger("kvpersist")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] kvpersist %(levelname)s: "
                                               "%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _attaching(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state.storage_manager = self
        self.register_l2_listener(state.clean)
        for manager in self._l1_managers_by_id.values():
            manager.reserve_write = functools.partial(eviction.reserve_write, state, manager,
                                                      manager.reserve_write)
        controller = self._prefetch_controller
        controller._plan_load = functools.partial(lookup_window.plan_load, state, controller,
                                                  controller._plan_load)
        transition = controller._transition_to_load_phase

        def load_phase(request: Any) -> None:
            state.in_load_phase(request.request_id)
            try:
                transition(request)
            finally:
                state.in_load_phase(None)

        controller._transition_to_load_phase = load_phase
        submit = self.submit_prefetch_task

        def submitting(spec: Any, external_request_id: str = "", skip_l2: bool = False) -> Any:
            model = state.lookup_model
            if model is not None:
                state.remember_lookup(spec.key_groups, model)
            return submit(spec, external_request_id=external_request_id, skip_l2=skip_l2)

        self.submit_prefetch_task = submitting
        logger.info("kvpersist: L1 window installed (%.3f GiB per streamed window%s)",
                    state.window_bytes / 2**30,
                    "" if state.window_bytes > 0 else ": streaming off")

    return init


def _remembering_lookups(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def lookup(self: Any, key: Any, tp_size: int) -> None:
        state.lookup_model = (key.model_name, key.world_size)
        try:
            original(self, key, tp_size)
        finally:
            state.lookup_model = None

    return lookup


def _reporting_promise(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def consume(self: Any, job: Any) -> int | None:
        landed = original(self, job)
        if landed is None:
            return None
        return lookup_window.reported_hit(state, job, int(landed), self._ctx.chunk_size)

    return consume


def _releasing(original: Callable[..., Any], state: WindowState,
               abandoned: AbandonedLookups) -> Callable[..., Any]:
    def released(request_id: str) -> None:
        state.forget(request_id)
        state.stats.add(released_abandoned=1)

    def free_lookup_locks(self: Any, key: Any, tp_size: int) -> None:
        release_when_done(abandoned, self, original, key, tp_size, released)

    return free_lookup_locks


def _forgetting(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def end_session(self: Any, request_id: str) -> None:
        state.forget(request_id)
        original(self, request_id)

    return end_session


def _streaming(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def retrieve(self: Any, key: Any, instance_id: int, gpu_block_ids: list[list[int]],
                 event_ipc_handle: bytes, skip_first_n_tokens: int = 0) -> tuple[bytes, bool]:
        return streamed_retrieve.retrieve(state, self, original, key, instance_id,
                                          gpu_block_ids, event_ipc_handle, skip_first_n_tokens)

    return retrieve


def _registering(original: Callable[..., Any], state: WindowState) -> Callable[..., Any]:
    def register(self: Any, instance_id: int, kv_caches: Any, model_name: str,
                 world_size: int, *args: Any, **kwargs: Any) -> Any:
        state.registered(model_name, world_size, engine_driven=False)
        return original(self, instance_id, kv_caches, model_name, world_size, *args, **kwargs)

    return register


def _registering_engine_driven(original: Callable[..., Any], state: WindowState
                               ) -> Callable[..., Any]:
    def register(self: Any, payload: Any) -> Any:
        state.registered(payload.model_name, payload.world_size, engine_driven=True)
        return original(self, payload)

    return register
