"""The private state of LMCache's MP connector and its scheduler and worker adapters, read and
changed only here.

LMCache 0.5.6 keeps what kvpersist needs to guard a transfer in attributes set by the adapters'
constructors (``_heartbeat_interval``, ``_mq_timeout``, ``_health_event(s)``,
``_dropped_retrieves``, ``_failed_request_ids``, ``_pending_store_kv_events``) and in the
connector's request trackers.  Each accessor belongs to a feature of :mod:`.pins`, whose pinned
constructors set these attributes.

Invariants
----------
* An attribute that is not there raises :class:`CompatError` naming it: there is no silent
  default (a guessed heartbeat or timeout would make every long restore look stalled, or a
  dead server look alive).  The connector turns it into a closed gate.
* :class:`AdapterView` shadows attributes only for the one call it is passed to; the adapter
  itself is changed only by :func:`forget_transfers`, the late-attach deferral and
  :func:`register_again_when_answered`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger("vllm.kvpersist.lmcache_compat")


class CompatError(RuntimeError):
    """An LMCache internal kvpersist relies on is not there."""


def require(obj: Any, name: str) -> Any:
    """``obj.name``, or CompatError naming both: the loud read of an LMCache internal."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise CompatError(f"LMCache's {type(obj).__name__} has no {name} (kvpersist was written "
                          "against LMCache 0.5.6)") from None



# -- heartbeat and timeouts (both adapters)
def heartbeat_interval_s(adapter: Any) -> float:
    """Seconds between the adapter's heartbeat pings (``lmcache.mp.heartbeat_interval``)."""
    return float(require(adapter, "_heartbeat_interval"))


def mq_timeout_s(adapter: Any) -> float:
    """The adapter's per-request wait (``lmcache.mp.mq_timeout``)."""
    return float(require(adapter, "_mq_timeout"))


# -- the worker's transfers in flight (feature load_fence)
class AdapterView:
    """The adapter as one of LMCache's methods sees it: ``overrides`` shadow attributes (reads
    and writes), everything else is the adapter's own object."""

    def __init__(self, adapter: Any, **overrides: Any) -> None:
        object.__setattr__(self, "_kvp_adapter", adapter)
        object.__setattr__(self, "_kvp_own", overrides)

    def __getattr__(self, name: str) -> Any:
        own = object.__getattribute__(self, "_kvp_own")
        if name in own:
            return own[name]
        return getattr(object.__getattribute__(self, "_kvp_adapter"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        own = object.__getattribute__(self, "_kvp_own")
        if name in own:
            own[name] = value
        else:
            setattr(object.__getattribute__(self, "_kvp_adapter"), name, value)


def dropped_retrieve_count(adapter: Any) -> int:
    """Retrieves dropped at submit (never sent) that ``get_finished`` has yet to report."""
    return len(require(adapter, "_dropped_retrieves"))


def failed_request_ids(adapter: Any) -> set[str]:
    """Requests whose load ``get_finished`` has reported failed so far (a copy)."""
    return set(require(adapter, "_failed_request_ids"))


def healthy_view(adapter: Any) -> AdapterView:
    """The adapter as if its heartbeat were healthy: ``get_finished`` then judges each
    transfer by the server's answer, and holds the ones not answered."""
    return AdapterView(adapter, is_healthy=True)


def drain_view(adapter: Any, retrieves: set[str], stores: set[str]) -> AdapterView:
    """The adapter as if unhealthy and holding only ``retrieves`` and ``stores``: LMCache's
    unhealthy branch of ``get_finished`` then reports exactly those as finished (failed loads,
    dropped stores)."""
    pending = require(adapter, "_pending_store_kv_events")
    return AdapterView(
        adapter, is_healthy=False, _dropped_retrieves=set(),
        retrieve_futures={r: adapter.retrieve_futures[r] for r in retrieves},
        store_futures={s: adapter.store_futures[s] for s in stores},
        retrieve_events={r: e for r, e in adapter.retrieve_events.items() if r in retrieves},
        store_events={s: e for s, e in adapter.store_events.items() if s in stores},
        _pending_store_kv_events={s: e for s, e in pending.items() if s in stores})


def forget_transfers(adapter: Any, retrieves: Iterable[str], stores: Iterable[str]) -> None:
    """Remove transfers a :func:`drain_view` call reported from the adapter's own books."""
    pending = require(adapter, "_pending_store_kv_events")
    for rid in retrieves:
        adapter.retrieve_futures.pop(rid, None)
        adapter.retrieve_events.pop(rid, None)
    for rid in stores:
        adapter.store_futures.pop(rid, None)
        adapter.store_events.pop(rid, None)
        pending.pop(rid, None)


# -- late attach (feature late_attach)
@contextlib.contextmanager
def chunk_size_without_server(chunk_size: int) -> Iterator[None]:
    """Within the block, LMCache's adapters take ``chunk_size`` instead of asking the server.
    Used only around the connector's construction (vLLM builds connectors one at a time)."""
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapters

    original = adapters.get_lmcache_chunk_size

    def known(_client: Any, timeout: float | None = None) -> int:
        return chunk_size

    adapters.get_lmcache_chunk_size = known
    try:
        yield
    finally:
        adapters.get_lmcache_chunk_size = original


def start_scheduler_unhealthy(adapter: Any) -> None:
    """Mark every server unhealthy and start the heartbeat that will notice it answering."""
    for event in require(adapter, "_health_events").values():
        event.clear()
    adapter._ensure_heartbeat_started()


def defer_worker_registration(adapter: Any) -> None:
    """The worker's first KV-cache registration is kept for the heartbeat's recovery callback
    (LMCache's own re-registration path) instead of being sent to a server that is not there."""
    require(adapter, "_health_event").clear()

    def deferred(kv_caches: Any) -> None:
        adapter.kv_caches = kv_caches
        del adapter._send_register_kv_caches_request  # the class's method from now on
        adapter._ensure_heartbeat_started()
        logger.warning("kvpersist: KV caches kept for registration once the LMCache server "
                       "answers (worker %s)", getattr(adapter, "instance_id", "?"))

    adapter._send_register_kv_caches_request = deferred


def register_again_when_answered(adapter: Any) -> None:
    """A worker whose registration went unanswered within ``mq_timeout`` turns unhealthy with its
    heartbeat running: LMCache's recovery callback sends the registration again on the first
    answered ping, and the worker turns healthy only once that one is answered in time (which
    is what marks LMCache's transfer context registered).  The server keeps one registration
    per worker instance (a second one of the same instance only refreshes it), so the late one
    it may still handle and the new one name the same shared-memory segment.  While unhealthy,
    LMCache drops the worker's stores and fails its loads (vLLM recomputes them)."""
    require(adapter, "_health_event").clear()
    adapter._ensure_heartbeat_started()
    logger.warning("kvpersist: the LMCache server did not answer this worker's registration in "
                   "time: registering again once it answers (worker %s)",
                   getattr(adapter, "instance_id", "?"))


# -- the connector's request trackers (feature lookup_control)
def mark_bypassed(connector: Any, request: Any) -> Any | None:
    """Mark ``request`` as bypassing LMCache (no load, no store) in ``connector``'s tracker.
    Returns the tracker as it was (for releasing the lookup), or None if it already bypassed."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

    tracker = tracker_of(connector, request)
    if tracker.state == LMCacheMPRequestState.BYPASS_LMCACHE:
        return None
    return tracker


# -- the store fence (feature store_fence)
def transfer_context(adapter: Any) -> Any:
    """The worker adapter's transfer context, or None before the KV caches are registered."""
    return require(adapter, "transfer_ctx")


#: The worker adapter's methods that report finished transfers to vLLM (both variants).
FINISHED_METHODS = ("get_finished", "get_finished_with_lazy_offload")


def future_settled(future: Any) -> bool:
    """Whether an LMCache transfer future is settled: answered, or failed (a failed RPC is
    settled too: LMCache's ``result()`` raises it and the transfer is judged failed, and the
    server no longer touches the transfer's blocks)."""
    try:
        return bool(future.query())
    except Exception:
        return True


def store_futures(adapter: Any) -> dict[str, Any]:
    """The worker adapter's store future of each request (the latest store LMCache sent for it;
    it pops one when it sees it settled)."""
    return dict(require(adapter, "store_futures"))


def take_inflight_stores(ctx: Any) -> list[Any] | None:
    """Take the stores an ``lmcache_driven`` context has in flight (the server may still read
    their blocks), leaving it none, as its own flush does; None for a context that keeps no
    such list (``engine_driven`` copies a store out of the blocks before sending it)."""
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
        LMCacheDrivenTransferContext,
    )

    if not isinstance(ctx, LMCacheDrivenTransferContext):
        return None
    with require(ctx, "_inflight_lock"):
        pending = list(require(ctx, "_inflight_stores"))
        ctx._inflight_stores = []
    return pending


def synchronize_device() -> None:
    """What LMCache's flush does after its waits: the device's queued work is done."""
    from lmcache import torch_dev

    torch_dev.synchronize()


#: The attribute kvpersist sets on each LMCache request tracker it has keyed: the salt it gave
#: the tracker, or the :class:`~kvpersist.serving.connector.request_keys.Uncacheable` that stopped it.
_KEY_MARK = "_kvp_request_key"


def key_new_trackers(connector: Any, key: Callable[[Any, Any], None]) -> None:
    """Have ``key(request, tracker)`` run on every request tracker ``connector`` hands out, before
    LMCache itself uses it (LMCache reaches its trackers only through this method)."""
    original = require(connector, "_get_or_create_request_tracker")

    def keyed(request: Any) -> Any:
        tracker = original(request)
        key(request, tracker)
        return tracker

    connector._get_or_create_request_tracker = keyed


def trackers(connector: Any) -> list[Any]:
    """Every request tracker ``connector`` holds now."""
    return list(require(connector, "request_trackers").values())


def tracker_of(connector: Any, request: Any) -> Any:
    """LMCache's tracker of ``request`` (created, and keyed by kvpersist, if new)."""
    return connector._get_or_create_request_tracker(request)


def tracker_mark(tracker: Any) -> Any:
    """What :func:`mark_tracker` recorded on ``tracker``, or None if it is not keyed yet."""
    return getattr(tracker, _KEY_MARK, None)


def mark_tracker(tracker: Any, key: Any) -> None:
    setattr(tracker, _KEY_MARK, key)


def set_tracker_salt(tracker: Any, salt: str) -> None:
    """The salt every key of ``tracker``'s request is made with (lookup, load, store, lock
    release all read ``tracker.cache_salt``)."""
    require(tracker, "cache_salt")
    tracker.cache_salt = salt


def key_items_by_content(tracker: Any, request: Any, item_digests: list[str]) -> None:
    """Write values of each multimodal item's content digest over its placeholder tokens in
    ``tracker``'s token IDs, where LMCache wrote values of vLLM's label for it (the same
    substitution, ``apply_mm_hashes_to_token_ids``, with the digests in place of the labels)."""
    import torch
    from lmcache.integration.vllm.utils import apply_mm_hashes_to_token_ids

    require(tracker, "mm_adjusted_prompt_ids")
    prompt_ids = torch.tensor(request.prompt_token_ids)
    apply_mm_hashes_to_token_ids(prompt_ids, item_digests,
                                 [feature.mm_position for feature in request.mm_features])
    tracker.mm_adjusted_prompt_ids = prompt_ids.tolist()


def store_nothing(tracker: Any) -> None:
    """No chunk of ``tracker``'s request is ever stored (LMCache bounds its stores by
    ``max_offload_tokens``)."""
    require(tracker, "max_offload_tokens")
    tracker.max_offload_tokens = 0


def is_fresh(tracker: Any) -> bool:
    """Whether ``tracker`` is still in LMCache's first state (no lookup decided yet)."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

    return bool(tracker.state == LMCacheMPRequestState.PREFETCHING)


def finish_bypass(tracker: Any) -> None:
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

    tracker.num_lmcache_hit_tokens = 0
    tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE


def replace_connector_stats(connector: Any, stats: Any) -> None:
    """``connector``'s stats object (vLLM's /metrics for the connector) becomes ``stats``."""
    require(connector, "_connector_stats")
    connector._connector_stats = stats
