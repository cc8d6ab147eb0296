"""The worker's part of kvpersist's connector: how long a worker waits for the server, and when a
transfer into vLLM's KV memory may be reported finished.

vLLM builds one connector per worker process; this object holds what only a worker has, as
vLLM's own ``OffloadingConnectorWorker`` does.  The scheduler's part is
:mod:`kvpersist.serving.connector.scheduler.side`.

Invariants
----------
* The worker waits for a restore's KV while the server is alive, up to
  ``kvpersist.lookup_max_s``, and for a store's receipt only while it is healthy; neither once
  nobody listens at the server's admin socket (:mod:`kvpersist.serving.connector.worker.transfer_wait`).
* No transfer into vLLM's KV memory is reported finished while the server may still write it
  (:mod:`kvpersist.serving.connector.worker.load_fence`); a failed load keeps the chunks the server served
  (:mod:`kvpersist.serving.connector.worker.served_prefix`).
* Before the forward pass of a step that preempted requests, no store the server may still
  read out of vLLM's KV memory is in flight (:mod:`kvpersist.serving.connector.worker.store_fence`).
* A late-attaching worker keeps its KV caches for registration until the server answers; a
  worker whose registration went unanswered registers again once the server answers, and
  transfers nothing until then (:meth:`WorkerSide.register_again_when_answered`).
"""

from __future__ import annotations

from typing import Any

from ....config.client import ConnectorOptions
from ... import http
from ...lmcache_compat import adapters as lmcache_adapters
from ...lmcache_compat import pickle_transport
from ..heartbeat import dead_after_s
from ..metrics import KvPersistConnectorStats
from .load_fence import LoadFence
from .served_prefix import ServedPrefixKeeper
from .store_fence import StoreFence
from .transfer_wait import ServerWait, never_gone


class WorkerSide:
    """kvpersist's state in a worker's connector (see module invariants)."""

    def __init__(self, adapter: Any, options: ConnectorOptions, stats: KvPersistConnectorStats,
                 *, attach_late: bool) -> None:
        url = options.http_url
        heartbeat = lmcache_adapters.heartbeat_interval_s(adapter)
        self.waits_installed = pickle_transport.install(ServerWait(
            lambda: bool(adapter.is_healthy),
            gone=(lambda: http.refuses_connections(url)) if url else never_gone,
            base_s=lmcache_adapters.mq_timeout_s(adapter), max_s=options.lookup_max_s,
            dead_after_s=dead_after_s(heartbeat)))
        self._adapter = adapter
        self.fence = LoadFence(adapter, server_url=url, record=stats.record_failed_load,
                               keeper=ServedPrefixKeeper(adapter, url))
        self.fence.install()
        self.store_fence = StoreFence(adapter, server_url=url, server_of=self.fence.server_of)
        self.store_fence.install()
        if attach_late:
            lmcache_adapters.defer_worker_registration(adapter)

    def register_again_when_answered(self) -> None:
        """The server did not answer this worker's registration within ``mq_timeout`` (a server
        busy for longer, or stopped): the worker stays attached but unhealthy, registers again
        once the server answers, and until then its stores are dropped and its loads fail
        (:func:`~kvpersist.serving.lmcache_compat.adapters.register_again_when_answered`)."""
        lmcache_adapters.register_again_when_answered(self._adapter)
