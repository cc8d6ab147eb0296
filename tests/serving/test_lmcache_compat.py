"""The contract with LMCache's and vLLM's internals (:mod:`kvpersist.serving.lmcache_compat`):
every function kvpersist relies on is the one it was written against, every private attribute
it reads is set where the pinned code sets it, vLLM's class-level calls are answered, and a
changed function turns its feature off (closing the gate where exactness depends on it)."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.serving.connector import kv_connector as connector_module
from kvpersist.serving.lmcache_compat import adapters, pins, status

SOURCES = [(f.name, module, qualname, digest) for f in pins.FEATURES.values()
           for module, qualname, digest in f.sources]
COMPAT = Path(pins.__file__).parent


@pytest.mark.parametrize(("feature", "module", "qualname", "digest"), SOURCES,
                         ids=[f"{f}:{q}" for f, _, q, _ in SOURCES])
def test_every_pinned_function_is_the_one_kvpersist_was_written_against(
        feature: str, module: str, qualname: str, digest: str) -> None:
    from kvpersist.serving.lmcache_compat import pickle_transport

    pickle_transport.uninstall()  # a test that installed the waits must not hide LMCache's own
    assert pins.source_digest(module, qualname) == digest, (
        f"LMCache/vLLM changed {qualname}: review kvpersist's {feature} against it "
        "(lmcache_compat), then update its pin")


def test_the_installed_versions_are_the_tested_ones() -> None:
    assert pins.installed_versions() == pins.TESTED_VERSIONS


def test_the_digest_sees_through_lmcache_decorators() -> None:
    # L1Manager's methods are wrapped by a lock decorator without functools.wraps: two of them
    # must not hash to the decorator's one source.
    digests = {pins.source_digest("lmcache.v1.distributed.l1_manager", name)
               for name in ("L1Manager.reserve_write", "L1Manager.delete")}
    assert len(digests) == 2


@pytest.mark.parametrize(("qualname", "attributes"), [
    ("LMCacheMPWorkerAdapter.__init__",
     ["_heartbeat_interval", "_mq_timeout", "_health_event", "retrieve_futures",
      "store_futures", "retrieve_events", "store_events", "_pending_store_kv_events",
      "_dropped_retrieves", "_failed_request_ids", "error_block_ids", "blocks_in_chunk",
      "instance_id", "kv_caches"]),
    ("LMCacheMPSchedulerAdapter.__init__", ["_heartbeat_interval", "_mq_timeout",
                                            "_health_events"]),
    ("LMCacheMPConnector.__init__", ["_connector_stats"]),
    ("StorageManager.__init__", ["_eviction_controllers"]),
    ("L1EvictionController.__init__", ["_eviction_policy", "_l1_manager"]),
    ("LRUEvictionPolicy.__init__", ["_lock", "_order"]),
    ("L1Manager.__init__", ["_objects"]),
])
def test_every_private_attribute_read_is_set_by_the_pinned_constructor(
        qualname: str, attributes: list[str]) -> None:
    module = {"LMCacheMPConnector.__init__": "lmcache.integration.vllm.lmcache_mp_connector",
              "StorageManager.__init__": "lmcache.v1.distributed.storage_manager",
              "L1EvictionController.__init__":
                  "lmcache.v1.distributed.storage_controllers.eviction_controller",
              "LRUEvictionPolicy.__init__": "lmcache.v1.distributed.eviction_policy.lru",
              "L1Manager.__init__": "lmcache.v1.distributed.l1_manager"}.get(
        qualname, "lmcache.integration.vllm.vllm_multi_process_adapter")
    cls = pins.resolve(module, qualname.rsplit(".", 1)[0])
    source = inspect.getsource(cls)  # constructors delegate to helpers of the same class
    missing = [a for a in attributes if f"self.{a} " not in source and f"self.{a}:" not in source
               and f"self.{a}=" not in source]
    assert missing == [], f"{cls.__name__} no longer sets {missing}"


def test_the_class_methods_vllm_calls_on_the_connector_class_are_answered() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class_level = {name for name, member in vars(KVConnectorBase_V1).items()
                   if isinstance(member, (classmethod, staticmethod))}
    assert class_level, "vLLM's connector base has no class-level API any more?"
    own = vars(connector_module.KvPersistConnector)
    assert sorted(class_level - set(own)) == []


def test_only_the_compat_package_touches_lmcache_internals() -> None:
    """Outside lmcache_compat no kvpersist module names a private LMCache attribute."""
    names = {"_heartbeat_interval", "_mq_timeout", "_health_events", "_health_event",
             "_ensure_heartbeat_started", "_send_register_kv_caches_request",
             "get_lmcache_chunk_size", "_get_or_create_request_tracker", "_connector_stats",
             "_dropped_retrieves", "_failed_request_ids", "_pending_store_kv_events",
             "EngineDrivenContextPickle", "MessageQueueServer", "_vllm_config",
             "_kv_cache_config", "_plan_load", "_consume_prefetch_result",
             "_inflight_stores", "_inflight_lock", "transfer_ctx", "_eviction_controllers",
             "_eviction_policy", "_l1_manager", "_order", "_objects"}
    package = COMPAT.parent.parent
    offenders = []
    for path in package.rglob("*.py"):
        if COMPAT in path.parents:
            continue
        text = path.read_text(encoding="utf-8")
        offenders += [f"{path.relative_to(package)}: {n}" for n in names
                      if re.search(rf"(?<![A-Za-z0-9_]){n}(?![A-Za-z0-9_])", text)]
    assert offenders == []


def change_pin(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Feature ``name``'s first function pinned to a digest no source has, as after an LMCache
    upgrade that changed it."""
    feature = pins.FEATURES[name]
    module, qualname, _ = feature.sources[0]
    monkeypatch.setitem(pins.FEATURES, name, pins.Feature(
        feature.name, feature.purpose, feature.if_off,
        ((module, qualname, "0" * 16), *feature.sources[1:]), feature.unsafe_without))
    pins.available.cache_clear()


@pytest.fixture
def changed_feature(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    change_pin(monkeypatch, "load_fence")
    yield "load_fence"
    monkeypatch.undo()
    pins.available.cache_clear()


def test_a_patch_whose_pins_changed_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replacing feature leaves LMCache's own code in place when its pins do not match."""
    import socket

    from lmcache.v1.multiprocess.modules import lookup
    from lmcache.v1.multiprocess.transfer_context.pickle import EngineDrivenContextPickle

    from kvpersist.serving.connector.worker.transfer_wait import ServerWait
    from kvpersist.serving.lmcache_compat import l1_window, pickle_transport, unix_endpoints

    for name in ("l1_window", "pickle_waits", "unix_endpoints"):
        change_pin(monkeypatch, name)
    try:
        lookup_before = lookup.LookupModule.lookup
        assert l1_window.install(1 << 30) is None
        assert lookup.LookupModule.lookup is lookup_before
        pickle_transport.uninstall()
        prepare_before = EngineDrivenContextPickle.prepare_retrieve
        assert not pickle_transport.install(ServerWait(lambda: True, base_s=1.0, max_s=1.0,
                                                       dead_after_s=1.0))
        assert EngineDrivenContextPickle.prepare_retrieve is prepare_before
        with socket.socket(socket.AF_UNIX) as listener, pytest.raises(
                unix_endpoints.EndpointsError, match="refusing to start"):
            unix_endpoints.install(Path("/nonexistent/request.sock"), listener,
                                   before_bind=lambda: None, after_bind=lambda: None)
    finally:
        monkeypatch.undo()
        pins.available.cache_clear()


def test_a_changed_function_turns_its_feature_off_with_one_line(
        changed_feature: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.kvpersist.lmcache_compat"):
        assert not pins.available(changed_feature)
        assert not pins.available(changed_feature)  # decided once per process
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "load_fence is OFF" in lines[0] and "LMCacheMPWorkerAdapter.__init__" in lines[0]
    (reason,) = pins.unsafe_reasons()
    assert "load_fence" in reason and "gate closes" in reason
    assert pins.available("lookup_control")  # the other features are untouched


def test_a_missing_private_attribute_is_an_error_naming_it() -> None:
    class Adapter:
        _heartbeat_interval = 2

    assert adapters.heartbeat_interval_s(Adapter()) == 2.0
    with pytest.raises(adapters.CompatError, match="Adapter has no _mq_timeout"):
        adapters.mq_timeout_s(Adapter())


def test_status_readers_accept_any_shape() -> None:
    for junk in ({}, {"storage_manager": []}, {"storage_manager": {"l2_adapters": {"a": 1}}},
                 {"cache_context_meta": "garbage"}):
        assert status.progress_token(junk) == (0.0,) * 5
        assert status.kvpersist_adapters(junk) == []
        assert status.registered_namespaces(junk) == {}


def test_the_server_serves_one_client_s_stores_and_loads_in_the_order_sent() -> None:
    """What ``store_order`` pins, checked on LMCache's own objects: its lmcache_driven STORE
    and RETRIEVE handlers ask for client affinity, and its affinity pool runs one client's
    tasks one after the other, in the order submitted, even when the first is slow.  (LMCache
    keeps one store future per request, so a later store settling must mean every earlier one
    has.)  Fails if LMCache starts serving a client's requests concurrently or out of order."""
    import threading
    import time

    from lmcache.v1.multiprocess import request_handler
    from lmcache.v1.multiprocess.affinity_pool import AffinityThreadPool
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule,
    )

    for name in ("store", "retrieve"):
        options = getattr(getattr(LMCacheDrivenTransferModule, name),
                          request_handler._HANDLER_OPTIONS_ATTR)
        assert options.requires_client_affinity, name
        assert options.handler_type is request_handler.HandlerType.BLOCKING, name

    pool = AffinityThreadPool(max_workers=4, thread_name_prefix="kvp-contract")
    done: list[str] = []
    lock = threading.Lock()

    def task(name: str, seconds: float) -> str:
        time.sleep(seconds)
        with lock:
            done.append(name)
        return name

    client = hash(b"client-identity")
    first = pool.submit(task, "first store (slow)", 0.3, affinity_key=client)
    second = pool.submit(task, "second store", 0.0, affinity_key=client)
    other = pool.submit(task, "another client", 0.0, affinity_key=hash(b"other"))
    assert other.result(timeout=10) == "another client"
    assert not second.done()  # not served while the first of its client still runs
    assert second.result(timeout=10) == "second store"
    assert first.done()
    assert done.index("first store (slow)") < done.index("second store")
    pool.shutdown()
