"""kvpersist's vLLM KV connector: LMCache's MP connector behind a fail-closed identity gate.

vLLM loads it with ``--kv-transfer-config`` ``{"kv_connector": "KvPersistConnector",
"kv_connector_module_path": "kvpersist.connector", ...}`` (``kvp-vllm`` writes this).  Its
``kvpersist.*`` extra-config keys are parsed by :class:`kvpersist.config.client.ConnectorOptions`.

Shape: composition.  :class:`KvPersistConnector` is the class vLLM instantiates; in ``__init__``
the gate (:mod:`kvpersist.serving.connector.gate`) chooses what it holds in ``inner``: a
:class:`NamespacedLMCacheConnector` (caching on) or a :class:`DisabledKvConnector` (off), and
every method of vLLM's connector API forwards to it (the forwarders are generated from
``KVConnectorBase_V1`` so that none is missed; they are the only forwarding).  vLLM calls a
few class methods on the class itself before any instance exists (layout, stats, Prometheus
metrics); they are LMCache's.  kvpersist's additions are split by role, as in vLLM's
``OffloadingConnector``: :class:`~kvpersist.serving.connector.scheduler.side.SchedulerSide` in the
scheduler's connector, :class:`~kvpersist.serving.connector.worker.side.WorkerSide` in each worker's.
LMCache's internals are reached only through :mod:`kvpersist.serving.lmcache_compat`; when a
pinned internal that exactness depends on changed, the gate closes.

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
* **A registration the server refuses or answers late is caching off, never an outage**, and
  vLLM starts (:meth:`KvPersistConnector.register_kv_caches`).  A refusal closes the worker's
  gate.  A registration left unanswered within ``mq_timeout`` leaves the worker attached but
  unhealthy: it registers again once the server answers a ping, and transfers nothing until
  that second registration is answered in time (LMCache marks its transfer context registered
  only then; a store sent to an unregistered context raises in vLLM's forward step, measured
  with the server stopped through a registration).  The worker reports itself *pending* in the
  handshake, and the scheduler then makes no lookup and stores nothing until the server's
  ``/status`` lists every worker registered (as for an engine started before the server).
* **Every layer computes on the memory the server maps.**  After LMCache's registration moved
  the KV caches into shared memory, layer views it did not re-point (MLA's) are re-pointed
  (:mod:`kvpersist.serving.lmcache_compat.kv_views`); a view left behind closes the gate.
* **The scheduler never promises hits that no worker loads.**  Each worker reports whether its
  gate opened through vLLM's worker→scheduler handshake (:meth:`get_handshake_metadata`, which
  the engine collects after the workers registered their KV caches and hands to the scheduler's
  connector before serving starts); a scheduler that learns of a closed worker closes too.  No
  state is kept outside the processes.
* **An engine started before the cache server attaches by itself** once the server answers and
  lists the engine's workers as registered
  (:mod:`kvpersist.serving.connector.scheduler.late_attach`); until then it serves uncached
  and promises no hit.
* **A dead or stalled cache service never stalls serving; a long restore is never abandoned
  while it progresses.**  A lookup (which includes the L2→L1 load) is abandoned, and the request
  recomputed, when the heartbeat says the server is down, after ``kvpersist.lookup_timeout_s``
  without progress, or after ``kvpersist.lookup_max_s`` in all
  (:mod:`kvpersist.serving.connector.scheduler.lookup_deadline`).  LMCache's heartbeat marks
  the server unhealthy and, once it answers again, re-registers the KV caches, so caching
  resumes without restarting vLLM.
"""

from __future__ import annotations

import abc
import copy
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...config.client import ConnectorOptions
from ...identity import CacheIdentity
from ...identity.adapter_records import record_adapter
from ...identity.weights_digest import FileDigestCache, default_cache_dir
from ..lmcache_compat import adapters as lmcache_adapters
from ..lmcache_compat import engine_config, engine_rpc, kv_views
from ..lmcache_compat import pins as lmcache_pins
from .gate import (
    AttachLate,
    Bypass,
    CacheOn,
    Closed,
    decide,
    engine_driven_with_groups,
    record_identity,
    registration_refusal,
    window_frees_unfenced,
)
from .metrics import KvPersistConnectorStats, KvPersistPromMetrics
from .platform_refusals import lora_batches_miscomputed, prefill_cannot_resume
from .request_keys import RequestKeys, lora_settings
from .scheduler.side import SchedulerSide
from .worker.side import WorkerSide

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.kvpersist.connector")  # inherits vLLM's log handler


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
    """What a worker tells its scheduler through vLLM's handshake: did its gate open, and is its
    registration still to be answered (``pending``; the reason says why)?"""

    caching: bool
    reason: str | None = None
    pending: bool = False


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
    """LMCache's MP connector with ``<model id>/<namespace>`` as model name, and kvpersist's part
    for this process's role: :class:`~kvpersist.serving.connector.scheduler.side.SchedulerSide` in the
    scheduler, :class:`~kvpersist.serving.connector.worker.side.WorkerSide` in a worker (the other is
    None)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
                 *, identity: CacheIdentity, options: ConnectorOptions,
                 attach_late: bool = False) -> None:
        named = with_model_name(vllm_config, identity.lmcache_model_name())
        if attach_late:
            assert options.chunk_size is not None
            with lmcache_adapters.chunk_size_without_server(options.chunk_size):
                super().__init__(named, role, kv_cache_config)
        else:
            super().__init__(named, role, kv_cache_config)
        self.kvp_identity = identity
        # LMCache's stats plus kvpersist's bypass, failed-load and dropped-store counts
        self.kvp_stats = KvPersistConnectorStats()
        lmcache_adapters.replace_connector_stats(self, self.kvp_stats)
        self.kvp_scheduler: SchedulerSide | None = None
        self.kvp_worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.kvp_scheduler = SchedulerSide(
                self, options, identity, self.kvp_stats, attach_late=attach_late,
                workers=int(vllm_config.parallel_config.world_size),
                keys=RequestKeys(lora_settings(vllm_config),
                                 on_keyed=functools.partial(_record_adapter, options),
                                 digests=FileDigestCache(default_cache_dir()),
                                 mm_bidirectional=bool(getattr(
                                     vllm_config.model_config, "is_mm_prefix_lm", False))))
            # every tracker LMCache creates is keyed before LMCache uses it
            lmcache_adapters.key_new_trackers(self, self.kvp_scheduler.key_tracker)
            if not engine_rpc.watch_weight_changes(self.kvp_scheduler.weights_changed):
                self.kvp_scheduler.weights_changed("(vLLM's EngineCore.collective_rpc cannot "
                                                   "be watched)")
        else:
            self.kvp_worker = WorkerSide(self.worker_adapter, options, self.kvp_stats,
                                         attach_late=attach_late)
        if attach_late:
            logger.warning("kvpersist: the LMCache server does not answer at start: serving "
                           "uncached, attaching when it answers (role %s)", role.name)

    def _scheduler(self) -> SchedulerSide:
        assert self.kvp_scheduler is not None, "a scheduler-side call in a worker"
        return self.kvp_scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """LMCache's lookup under kvpersist's deadline (see
        :meth:`~kvpersist.serving.connector.scheduler.side.SchedulerSide.lookup`)."""
        return self._scheduler().lookup(
            request, lambda: super(NamespacedLMCacheConnector, self).get_num_new_matched_tokens(
                request, num_computed_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """LMCache's metadata, less its stores while the heartbeat says the server is down."""
        metadata: KVConnectorMetadata = super().build_connector_meta(scheduler_output)
        self._scheduler().drop_stores_while_down(metadata, bool(self.lazy_offload))
        self._scheduler().drop_stores_after_weight_change(metadata)
        return metadata

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(request, block_ids)
        return result

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished_all_groups(
            request, block_ids)
        return result

    def shutdown(self) -> None:
        if self.kvp_scheduler is not None:
            engine_rpc.stop_watching(self.kvp_scheduler.weights_changed)
            self.kvp_scheduler.close()
        super().shutdown()


class KvPersistConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The connector vLLM instantiates: the gate's choice in ``inner``, every call forwarded."""

    inner: KVConnectorBase_V1

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._kvp_args = (vllm_config, role, kv_cache_config)  # for closing after the handshake
        #: Why this worker's registration is still to be answered (None: it was, or no worker)
        self._registration_pending: str | None = None
        lmcache_pins.check_versions()
        decision = decide(vllm_config)
        if isinstance(decision, (CacheOn, AttachLate)):
            unsafe = lmcache_pins.unsafe_reasons()
            for refusal in (engine_driven_with_groups(vllm_config, kv_cache_config),
                            window_frees_unfenced(vllm_config, kv_cache_config),
                            prefill_cannot_resume(vllm_config),
                            lora_batches_miscomputed(vllm_config),
                            registration_refusal(kv_cache_config,
                                                 decision.options.chunk_size)):
                if refusal is not None:
                    unsafe.append(refusal)
            unknown = engine_config.unknown_fields_reason()
            if unknown is not None:
                unsafe.append(unknown)
            if isinstance(decision, AttachLate) and not lmcache_pins.available("late_attach"):
                unsafe.append("the LMCache server does not answer at start, and kvpersist's "
                              "late attach does not match the installed LMCache")
            if unsafe:
                decision = Closed("; ".join(unsafe))
        if isinstance(decision, Bypass):
            self._bypass(vllm_config, role, kv_cache_config, decision.identity, decision.options)
        elif isinstance(decision, Closed):
            self._close(vllm_config, role, kv_cache_config, decision.reason)
        else:
            self._open(vllm_config, role, kv_cache_config, decision)

    def _open(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any,
              decision: CacheOn | AttachLate) -> None:
        late = isinstance(decision, AttachLate)
        try:
            self.inner = NamespacedLMCacheConnector(
                vllm_config, role, kv_cache_config, identity=decision.identity,
                options=decision.options, attach_late=late)
        except Exception as exc:  # LMCache could not start: serve without the cache
            self._close(vllm_config, role, kv_cache_config,
                        f"LMCache's connector failed to start: {type(exc).__name__}: {exc}")
            return
        logger.info("kvpersist: caching %s, namespace %s, LMCache model name %s (role %s)",
                    "pending (late attach)" if late else "ON", decision.identity.namespace,
                    decision.identity.lmcache_model_name(), role.name)
        _record_identity(role, decision.options, decision.identity)

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

    def _shut_and_close(self, reason: str) -> None:
        """Close a gate that had opened: LMCache's connector is shut down first."""
        with_suppressed_errors(self.inner.shutdown)
        self._close(*self._kvp_args, reason)

    @property
    def caching(self) -> bool:
        return not isinstance(self.inner, DisabledKvConnector)

    @property
    def disabled_reason(self) -> str | None:
        return self.inner.disabled_reason if isinstance(self.inner, DisabledKvConnector) else None

    # -- registration: a refusal or a late answer costs the cache, never the engine
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """LMCache's registration of this worker's KV caches with the server.  Whatever fails
        there never fails vLLM's start: no answer within ``mq_timeout`` leaves the worker
        pending (it registers again once the server answers; the scheduler attaches when the
        server lists it), anything else (the server refuses a layout or a window) closes this
        worker's gate, and the handshake then closes the scheduler's too (see module
        invariants)."""
        before = kv_views.storage_pointers(kv_caches) if self.caching else {}
        try:
            self.inner.register_kv_caches(kv_caches)
        except Exception as exc:
            if not self.caching:
                raise
            self._repoint_layer_views(before, kv_caches)
            if not self.caching:
                return
            why = f"{type(exc).__name__}: {exc}"
            worker = getattr(self.inner, "kvp_worker", None)
            if (isinstance(exc, ConnectionError) and worker is not None
                    and lmcache_pins.available("late_attach")):
                worker.register_again_when_answered()
                self._registration_pending = (f"the LMCache server did not answer this worker's "
                                              f"registration in time ({why})")
                return
            self._shut_and_close(f"the LMCache server did not register this worker's KV caches "
                                 f"({why}); vLLM serves uncached until it restarts")
        else:
            self._repoint_layer_views(before, kv_caches)

    def _repoint_layer_views(self, before: Mapping[str, int],
                             kv_caches: dict[str, torch.Tensor]) -> None:
        """Layers must compute on the memory the server maps (:mod:`..lmcache_compat.kv_views`);
        a layer view left on private memory closes the gate (its KV would be wrong)."""
        if not before:
            return
        # what LMCache migrated: its adapter's tensors (its own views of ours, where it edits)
        registered = getattr(getattr(self.inner, "worker_adapter", None), "kv_caches", None)
        moved = kv_views.moved_storages(before, registered or kv_caches)
        if not moved:
            return
        layers = {**self._kvp_args[0].compilation_config.static_forward_context,
                  "(the engine's KV caches)": kv_views.TensorBag(kv_caches)}
        repointed = kv_views.repoint_stale_views(layers, moved)
        if repointed:
            logger.info("kvpersist: %d layer view(s) of the KV cache re-pointed onto the shared "
                        "memory LMCache moved it to (e.g. %s)", len(repointed), repointed[0])
        stale = kv_views.stale_views(layers, moved)
        if stale:
            self._shut_and_close(f"layer view(s) {', '.join(stale[:3])} of the KV cache stay on "
                                 "memory the LMCache server does not map")

    # -- worker → scheduler handshake (see module invariants)
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        pending = self._registration_pending if self.caching else None
        return WorkerGateState(self.caching, pending or self.disabled_reason,
                               pending=pending is not None)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        if not self.caching:
            return
        closed = {rank: state for rank, state in metadata.items()
                  if not (isinstance(state, WorkerGateState) and state.caching)}
        if closed:
            rank, state = next(iter(closed.items()))
            why = state.reason if isinstance(state, WorkerGateState) else "no gate state reported"
            self._shut_and_close(f"worker (pp, tp) {rank} serves without the cache ({why})")
            return
        pending = {rank: state for rank, state in metadata.items()
                   if isinstance(state, WorkerGateState) and state.pending}
        if not pending:
            return
        rank, state = next(iter(pending.items()))
        scheduler = getattr(self.inner, "kvp_scheduler", None)
        if scheduler is None or not scheduler.attach_when_registered():
            self._shut_and_close(f"worker (pp, tp) {rank} is not registered ({state.reason}) and "
                                 "there is no server /status to learn when it is")
            return
        logger.warning("kvpersist: %d worker(s) not registered yet, e.g. (pp, tp) %s (%s): "
                       "serving uncached, attaching once the LMCache server lists them all",
                       len(pending), rank, state.reason)

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


def _record_identity(role: KVConnectorRole, options: ConnectorOptions,
                     identity: CacheIdentity) -> None:
    """The scheduler (one process per engine) records the identity behind the namespace."""
    if role is KVConnectorRole.SCHEDULER:
        recorded = record_identity(options, identity)
        if isinstance(recorded, str):
            logger.warning("kvpersist: %s", recorded)


def _record_adapter(options: ConnectorOptions, digest: str, name: str, folder: str) -> None:
    """The scheduler records each adapter it keys under a local cache root (for reports)."""
    root = options.cache_root
    if root is None or not Path(root).is_dir():
        return
    try:
        record_adapter(root, digest, name, folder)
    except (OSError, ValueError) as exc:
        logger.warning("kvpersist: could not record LoRA adapter %r under %s: %s",
                       name, root, exc)


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
