"""kvpersist's vLLM KV connector: LMCache's MP connector behind a fail-closed identity gate.

vLLM loads it with ``--kv-transfer-config`` ``{"kv_connector": "KvPersistConnector",
"kv_connector_module_path": "kvpersist.connector", ...}`` (``kvp-vllm`` writes this).  Its
``kvpersist.*`` extra-config keys are parsed by :class:`kvpersist.config.client.ConnectorOptions`.

Shape: composition.  :class:`KvPersistConnector` is the class vLLM instantiates; in ``__init__``
the gate (:mod:`kvpersist.serving.gate`) chooses what it holds in ``inner``: a
:class:`NamespacedLMCacheConnector` (caching on) or a :class:`DisabledKvConnector` (off), and
every method of vLLM's connector API forwards to it (the forwarders are generated from
``KVConnectorBase_V1`` so that none is missed).  vLLM calls a few class methods on the class
itself before any instance exists (layout, stats, Prometheus metrics); they are LMCache's.

Invariants
----------
* The identity is derived from the running engine's ``VllmConfig`` and checked against the
  pins, in every process that builds a connector (scheduler and each worker), the same way.
* With a complete, agreeing identity, LMCache sees ``<model id>/<namespace>`` as the model
  name, so every object key, and every L2 file name, carries the namespace.
* With ``KVP_CACHE_BYPASS`` on and a valid identity, the identity is recorded and logged, and
  the connector holds a :class:`DisabledKvConnector`.
* Otherwise, and also when a ``kvpersist.*`` setting is malformed, the connector holds a
  :class:`DisabledKvConnector`: it never contacts the LMCache server, reports no external hits,
  stores nothing, and logs the reason.  vLLM keeps serving.
* **The scheduler never promises hits that no worker loads.**  Each worker reports whether its
  gate opened through vLLM's worker→scheduler handshake (:meth:`get_handshake_metadata`, which
  the engine collects after the workers registered their KV caches and hands to the scheduler's
  connector before serving starts); a scheduler that learns of a closed worker closes too.  No
  state is kept outside the processes.
* **An engine started before the cache server attaches by itself** once the server answers and
  lists the engine's workers as registered (:mod:`kvpersist.serving.late_attach`); until then it
  serves uncached and promises no hit.
* **A dead or stalled cache service never stalls serving; a long restore is never abandoned
  while it progresses.**  A lookup (which includes the L2→L1 load) is abandoned, and the request
  recomputed, when the heartbeat says the server is down, after ``kvpersist.lookup_timeout_s``
  without progress, or after ``kvpersist.lookup_max_s`` in all
  (:mod:`kvpersist.serving.lookup_deadline`).  LMCache's heartbeat marks the server unhealthy
  and, once it answers again, re-registers the KV caches, so caching resumes without restarting
  vLLM.
"""

from __future__ import annotations

import abc
import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ..config.client import ConnectorOptions
from ..identity import CacheIdentity
from . import http
from .connector_metrics import KvPersistConnectorStats, KvPersistPromMetrics
from .gate import decide, record_identity
from .late_attach import (
    RegistrationWatch,
    chunk_size_without_server,
    defer_worker_registration,
    start_scheduler_unhealthy,
)
from .load_fence import LoadFence
from .lookup_deadline import LookupDeadline, ServerProgressProbe
from .served_prefix import ServedPrefixKeeper
from .transfer_wait import ServerWait, never_gone
from .transfer_wait import install as install_server_wait

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.kvpersist.connector")  # inherits vLLM's log handler


def dead_after_s(heartbeat_s: float) -> float:
    """How long the heartbeat must say *unhealthy* without a break before a live-looking
    server is taken for dead: several missed beats, and never under 5 s."""
    return max(3 * heartbeat_s, 5.0)


class GoneCache:
    """``http.refuses_connections(url)``, asked at most every ``every_s`` (it is called on the
    scheduler's thread for every pending lookup of every step)."""

    def __init__(self, url: str | None, every_s: float = 0.25) -> None:
        self._url = url
        self._every_s = every_s
        self._at = float("-inf")
        self._gone = False

    def __call__(self) -> bool:
        if self._url is None:
            return False
        now = time.monotonic()
        if now - self._at >= self._every_s:
            self._gone = http.refuses_connections(self._url)
            self._at = now
        return self._gone


def with_model_name(vllm_config: Any, model_name: str) -> Any:
    """A shallow copy of ``vllm_config`` whose ``model_config.model`` is ``model_name``.

    LMCache's connector takes its cache model name from ``model_config.model`` and reads
    nothing else from that attribute; all other config objects are shared, not copied.
    """
    cfg = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    object.__setattr__(model_config, "model", model_name)
    object.__setattr__(cfg, "model_config", model_config)
    return cfg


@dataclass(frozen=True)
class WorkerGateState(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler through vLLM's handshake: did its gate open?"""

    caching: bool
    reason: str | None = None


class _NoMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Metadata of a disabled connector: there is never anything to transfer."""


class DisabledKvConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A connector that does nothing: no hits, no stores, no server contact."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None,
                 *, reason: str = "") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.disabled_reason = reason

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class NamespacedLMCacheConnector(LMCacheMPConnector):  # type: ignore[misc]
    """LMCache's MP connector with ``<model id>/<namespace>`` as model name and a lookup that is
    abandoned only when the server stalls (:mod:`kvpersist.serving.lookup_deadline`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
                 *, identity: CacheIdentity, options: ConnectorOptions,
                 attach_late: bool = False) -> None:
        named = with_model_name(vllm_config, identity.lmcache_model_name())
        self._kvp_watch: RegistrationWatch | None = None
        if attach_late:
            assert options.chunk_size is not None
            with chunk_size_without_server(options.chunk_size):
                super().__init__(named, role, kv_cache_config)
        else:
            super().__init__(named, role, kv_cache_config)
        self.kvp_identity = identity
        adapter = self.scheduler_adapter if role is KVConnectorRole.SCHEDULER else getattr(
            self, "worker_adapter", None)
        heartbeat = float(getattr(adapter, "_heartbeat_interval", 2.0))
        self._kvp_deadline = LookupDeadline(options.lookup_timeout_s, options.lookup_max_s,
                                            dead_after_s=dead_after_s(heartbeat))
        self._kvp_server_gone = GoneCache(options.http_url)
        self._kvp_probe: ServerProgressProbe | None = None
        if role is KVConnectorRole.SCHEDULER and options.http_url:
            self._kvp_probe = ServerProgressProbe(options.http_url.rstrip("/") + "/status",
                                                  self._kvp_deadline)
        # LMCache's stats plus kvpersist's bypass and failed-load counts, in vLLM's /metrics
        self._connector_stats = KvPersistConnectorStats()
        self.kvp_fence: LoadFence | None = None
        if role is KVConnectorRole.WORKER:
            self._kvp_wait_for_restores(options)
            self._kvp_fence_loads(options)
        if attach_late:
            self._kvp_start_late(vllm_config, role, options)

    def _kvp_wait_for_restores(self, options: ConnectorOptions) -> None:
        """The worker waits for a restore's KV while the server is alive, up to
        ``kvpersist.lookup_max_s``, and for a store's receipt only while it is healthy; neither
        once nobody listens at the server's admin socket (:mod:`kvpersist.serving.transfer_wait`)."""
        adapter = getattr(self, "worker_adapter", None)
        if adapter is None:
            return
        heartbeat = float(getattr(adapter, "_heartbeat_interval", 2.0))
        url = options.http_url
        install_server_wait(ServerWait(
            lambda: bool(adapter.is_healthy),
            gone=(lambda: http.refuses_connections(url)) if url else never_gone,
            base_s=float(getattr(adapter, "_mq_timeout", 15.0)), max_s=options.lookup_max_s,
            dead_after_s=dead_after_s(heartbeat)))

    def _kvp_fence_loads(self, options: ConnectorOptions) -> None:
        """No transfer into vLLM's KV memory is reported finished while the server may still
        write it (:mod:`kvpersist.serving.load_fence`)."""
        adapter = getattr(self, "worker_adapter", None)
        if adapter is None:
            return
        self.kvp_fence = LoadFence(adapter, server_url=options.http_url,
                                   record=self._connector_stats.record_failed_load,
                                   keeper=ServedPrefixKeeper(adapter, options.http_url))
        self.kvp_fence.install()

    def _kvp_start_late(self, vllm_config: Any, role: KVConnectorRole,
                        options: ConnectorOptions) -> None:
        """See :mod:`kvpersist.serving.late_attach`."""
        if role is KVConnectorRole.SCHEDULER:
            start_scheduler_unhealthy(self.scheduler_adapter)
            if options.http_url:
                self._kvp_watch = RegistrationWatch(
                    options.http_url.rstrip("/") + "/status", self.kvp_identity.namespace,
                    workers=int(vllm_config.parallel_config.world_size))
        else:
            defer_worker_registration(self.worker_adapter)
        logger.warning("kvpersist: the LMCache server does not answer at start: serving "
                       "uncached, attaching when it answers (role %s)", role.name)

    @property
    def kvp_attached(self) -> bool:
        return self._kvp_watch is None or self._kvp_watch.attached
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """LMCache's lookup, abandoned (the request bypasses the cache and is recomputed) when
        the heartbeat says the server is down, when it makes no progress for
        ``kvpersist.lookup_timeout_s``, or after ``kvpersist.lookup_max_s`` in all."""
        rid = request.request_id
        if not self.kvp_attached:  # an engine started before the server: computed, no lookup
            self._kvp_skip(request)
            return 0, False
        self._kvp_deadline.begin(rid)
        healthy = bool(self.scheduler_adapter.is_healthy)
        verdict = self._kvp_deadline.verdict(rid, healthy=healthy,
                                             gone=not healthy and self._kvp_server_gone())
        if verdict is not None:
            why = verdict.text
            if self._kvp_probe is not None:
                why += f"; {self._kvp_probe.describe()}"
            self._kvp_bypass(request, why, verdict.reason)
            return 0, False
        if not healthy:
            # Missed beats of a live server: LMCache would answer 0 hits and drop the lookup;
            # the deadline above decides when it is dead (a refused socket, or unhealthy for
            # dead_after_s without progress).  Until then the request waits.
            return None, False
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
        if result[0] is not None:
            self._kvp_deadline.end(rid)
        return result

    def _kvp_skip(self, request: Any) -> bool:
        """Mark ``request`` as bypassing LMCache (no load, no store); False if it already was."""
        rid = request.request_id
        self._kvp_deadline.end(rid)
        tracker = self._get_or_create_request_tracker(request)
        if tracker.state == LMCacheMPRequestState.BYPASS_LMCACHE:
            return False
        self.scheduler_adapter.cleanup_lookup_result(rid)
        self._kvp_release_lookup(request, tracker)
        tracker.num_lmcache_hit_tokens = 0
        tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
        return True

    def _kvp_release_lookup(self, request: Any, tracker: Any) -> None:
        """Tell a live server that a lookup is given up, so that it returns the L1 buffers
        the lookup's prefetch holds (at once, or when a running load ends) instead of after the
        read-lock TTL.  Nothing is sent to a server the heartbeat calls down."""
        adapter = self.scheduler_adapter
        if not adapter.is_healthy or not self.kvp_attached:
            return
        chunk = int(getattr(adapter, "lmcache_tokens_per_chunk", 0) or 0)
        try:
            tokens = tracker.get_token_ids()
            end = len(tokens) // chunk * chunk if chunk else len(tokens)
            if end > 0:
                adapter.free_lookup_locks(token_ids=tokens, start=0, end=end,
                                          request_id=request.request_id,
                                          cache_salt=tracker.cache_salt,
                                          request_configs=tracker.request_configs)
        except Exception:  # the release is a courtesy; the TTL remains the backstop
            logger.exception("kvpersist: releasing the lookup of request %s failed",
                             request.request_id)

    def _kvp_bypass(self, request: Any, why: str, reason: str) -> None:
        rid = request.request_id
        if not self._kvp_skip(request):
            return
        self._connector_stats.record_bypass(reason)
        logger.warning("kvpersist: request %s bypasses the KV cache (%s); it is recomputed",
                       rid, why)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """LMCache's metadata, less its stores while the heartbeat says the server is down: a
        worker would otherwise block up to ``lmcache.mp.mq_timeout`` twice (prepare and commit)
        per store sent to a dead server before its own heartbeat notices.  Dropping them is what
        LMCache's worker does itself once it knows (``submit_store_request`` while unhealthy);
        with lazy offload the scheduler expects one receipt per store, so nothing is dropped."""
        metadata: KVConnectorMetadata = super().build_connector_meta(scheduler_output)
        if not self.scheduler_adapter.is_healthy and not self.lazy_offload:
            requests = getattr(metadata, "requests", [])
            kept = [r for r in requests if getattr(r, "direction", None) != "STORE"]
            if len(kept) != len(requests):
                self._connector_stats.record_dropped_stores("server_down",
                                                            len(requests) - len(kept))
                metadata.requests = kept  # type: ignore[attr-defined]
        return metadata

    def shutdown(self) -> None:
        if self._kvp_probe is not None:
            self._kvp_probe.close()
        if self._kvp_watch is not None:
            self._kvp_watch.close()
        super().shutdown()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._kvp_deadline.end(request.request_id)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(request, block_ids)
        return result

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._kvp_deadline.end(request.request_id)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished_all_groups(
            request, block_ids)
        return result


class KvPersistConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The connector vLLM instantiates: the gate's choice in ``inner``, every call forwarded."""

    inner: KVConnectorBase_V1

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        decision = decide(vllm_config)
        if decision.bypass and decision.identity is not None and decision.options is not None:
            self._bypass(vllm_config, role, kv_cache_config, decision.identity, decision.options)
        elif decision.enabled and decision.identity is not None and decision.options is not None:
            try:
                self.inner = NamespacedLMCacheConnector(
                    vllm_config, role, kv_cache_config, identity=decision.identity,
                    options=decision.options, attach_late=decision.attach_late)
            except Exception as exc:  # LMCache could not start: serve without the cache
                self._close(vllm_config, role, kv_cache_config,
                            f"LMCache's connector failed to start: {type(exc).__name__}: {exc}")
                return
            logger.info("kvpersist: caching %s, namespace %s, LMCache model name %s (role %s)",
                        "pending (late attach)" if decision.attach_late else "ON",
                        decision.identity.namespace, decision.identity.lmcache_model_name(),
                        role.name)
            _record_identity(role, decision.options, decision.identity)
        else:
            self._close(vllm_config, role, kv_cache_config, decision.reason or "gate closed")

    def _bypass(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
                identity: CacheIdentity, options: ConnectorOptions) -> None:
        reason = (f"KVP_CACHE_BYPASS is on: namespace {identity.namespace} resolved, but no "
                  "lookup and no store")
        logger.warning("kvpersist: %s (role %s); vLLM serves without the KV cache tier",
                       reason, role.name)
        _record_identity(role, options, identity)
        self.inner = DisabledKvConnector(vllm_config, role, kv_cache_config, reason=reason)

    def _close(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
               reason: str) -> None:
        logger.error("kvpersist: %s (role %s); vLLM serves without the KV cache tier",
                     reason, role.name)
        self.inner = DisabledKvConnector(vllm_config, role, kv_cache_config, reason=reason)

    @property
    def caching(self) -> bool:
        return not isinstance(self.inner, DisabledKvConnector)

    @property
    def disabled_reason(self) -> str | None:
        return self.inner.disabled_reason if isinstance(self.inner, DisabledKvConnector) else None

    # -- worker → scheduler handshake (see module invariants)
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return WorkerGateState(self.caching, self.disabled_reason)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        if not self.caching:
            return
        closed = {rank: state for rank, state in metadata.items()
                  if not (isinstance(state, WorkerGateState) and state.caching)}
        if not closed:
            return
        rank, state = next(iter(closed.items()))
        why = state.reason if isinstance(state, WorkerGateState) else "no gate state reported"
        with_suppressed_errors(self.inner.shutdown)
        self._close(self._vllm_config, self._role, self._kv_cache_config,
                    f"worker (pp, tp) {rank} serves without the cache ({why})")

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    # -- class-level API, asked of the class before any instance exists: LMCache's
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        layout: str | None = LMCacheMPConnector.get_required_kvcache_layout(vllm_config)
        return layout

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KvPersistConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return KvPersistPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(LMCacheMPConnector.requires_piecewise_for_cudagraph(extra_config))

    def __getattr__(self, name: str) -> Any:
        """Attributes the API does not define (LMCache's own, for tests and operators)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _record_identity(role: KVConnectorRole, options: ConnectorOptions,
                     identity: CacheIdentity) -> None:
    """The scheduler (one process per engine) records the identity behind the namespace."""
    if role is KVConnectorRole.SCHEDULER:
        recorded = record_identity(options, identity)
        if isinstance(recorded, str):
            logger.warning("kvpersist: %s", recorded)


def with_suppressed_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:
        logger.exception("kvpersist: error while closing LMCache's connector")


_OWN = {"__init__", "get_handshake_metadata", "set_xfer_handshake_metadata",
        "set_xfer_handshake_metadata_pp_aware"}


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: KvPersistConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _property_forwarder(name: str) -> property:
    return property(lambda self: getattr(self.inner, name))


def _install_forwarders() -> None:
    """Forward every instance method and property of vLLM's connector API to ``inner``."""
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name, member in vars(base).items():
            if name in _OWN or (name.startswith("__") and name.endswith("__")):
                continue
            if name in vars(KvPersistConnector):
                continue
            if isinstance(member, property):
                setattr(KvPersistConnector, name, _property_forwarder(name))
            elif callable(member) and not isinstance(member, (classmethod, staticmethod)):
                setattr(KvPersistConnector, name, _forwarder(name))
    abc.update_abstractmethods(KvPersistConnector)


_install_forwarders()
