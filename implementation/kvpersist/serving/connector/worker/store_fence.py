"""A store is fenced too: a block vLLM may reuse is never read by the server afterwards.

In ``lmcache_driven`` mode the LMCache server reads a store's KV straight out of vLLM's KV memory
(a ``/dev/shm`` segment on CPU, CUDA IPC on a GPU) on its own time, after the forward pass that
computed it; vLLM does not wait for that read.  When the scheduler preempts a request it frees
the request's blocks at once and may hand them to another request in the same step.  LMCache
0.5.6 guards this in the worker (``handle_preemptions`` → ``flush_inflight_stores``) with two
holes: it skips the flush altogether while its heartbeat calls the server unhealthy, and it
waits for each store at most ``mq_timeout``.  Past either, the other request's forward pass
overwrites blocks the server has yet to read, and the server publishes a chunk mixing two
requests' KV under the preempted request's key, with a valid checksum.

Invariants
----------
* Before the forward pass of a step that preempted requests, every store the worker sent in
  ``lmcache_driven`` mode has settled: the server answered it (on a GPU, its completion event
  was waited for by LMCache's own future), or the server process it was sent to is gone
  (:class:`~kvpersist.serving.connector.worker.server_process.ServerProcess`; where that process cannot be
  named, nobody listens at the server's socket).  A gone process can neither read the blocks
  nor publish what it read: a store given up is never published.
* There is no fixed timeout: a live but stalled server holds the step (the engine waits, and
  says so every ``report_every_s``) rather than letting its blocks be reused.  Its health as
  seen by the heartbeat does not matter; only the two facts above do.
* ``engine_driven`` needs no fence: the worker copies a store's KV out of its blocks itself
  before the store is sent (LMCache's flush is a no-op there).
* On a GPU (CUDA IPC) the rule is the same: LMCache's store future completes only after the
  server's copy from the exported blocks finished (``to_device_future``), and the fence then
  synchronizes the device as LMCache's flush does.

Installed per worker adapter instance: it replaces the adapter's ``handle_preemptions`` and calls
nothing of LMCache's flush (feature ``store_fence`` pins both).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ... import http
from ...lmcache_compat import adapters as lmcache_adapters
from .server_process import ServerProcess, listener_of

logger = logging.getLogger("vllm.kvpersist.store_fence")
Clock = Callable[[], float]
#: How long one wait on a store's reply lasts before the server's process is looked at again.
POLL_S = 0.2


def _settled(future: Any) -> bool:
    try:
        return bool(future.query())
    except Exception:  # a failed store's RPC is settled: the server no longer reads its blocks
        return True


class StoreFence:
    """The store fence of one LMCache worker adapter (see module invariants)."""

    def __init__(self, adapter: Any, *, server_url: str | None,
                 server_of: Callable[[Any], ServerProcess | None] | None = None,
                 listener: Callable[[str | None], ServerProcess | None] = listener_of,
                 refuses: Callable[[str], bool] = http.refuses_connections,
                 report_every_s: float = 10.0, clock: Clock = time.monotonic,
                 record: Callable[[str, int], None] | None = None) -> None:
        self._adapter = adapter
        self._url = server_url
        self._server_of = server_of or (lambda future: None)
        self._listener = listener
        self._refuses = refuses
        self._report_every_s = report_every_s
        self._clock = clock
        self._record = record or (lambda reason, count: None)
        self.flushes = 0  # preemption flushes that found stores in flight
        self.waited_s = 0.0  # time spent holding blocks for unsettled stores
        self.given_up = 0  # stores whose server process was gone

    def install(self) -> None:
        """Route the adapter's ``handle_preemptions`` through the fence."""
        original = type(self._adapter).handle_preemptions
        self._adapter.handle_preemptions = functools.partial(self._handle_preemptions, original)

    def _handle_preemptions(self, original: Callable[..., Any], need_flush: bool) -> None:
        if not need_flush:
            return
        ctx = lmcache_adapters.transfer_context(self._adapter)
        pending = lmcache_adapters.take_inflight_stores(ctx) if ctx is not None else None
        if pending is None:  # engine_driven (or not registered): LMCache's own flush
            original(self._adapter, need_flush)
            return
        self.settle(pending)
        lmcache_adapters.synchronize_device()

    def settle(self, futures: list[Any]) -> None:
        """Return once every future in ``futures`` settled or its server process is gone."""
        pending = [f for f in futures if not _settled(f)]
        if not pending:
            return
        self.flushes += 1
        servers = {id(f): self._server_of(f) for f in pending}
        fallback = self._listener(self._url)
        began = last_report = self._clock()
        while pending:
            pending = [f for f in pending if not _settled(f)]
            gone = [f for f in pending if self._gone(servers[id(f)] or fallback)]
            if gone:
                self.given_up += len(gone)
                self._record("server_gone", len(gone))
                logger.warning("kvpersist: the LMCache server of %d store(s) in flight is gone "
                               "(%s): they are dropped, and nothing can read their blocks any "
                               "more", len(gone), servers[id(gone[0])] or fallback
                               or "its socket refuses")
                pending = [f for f in pending if f not in gone]
            if not pending:
                break
            now = self._clock()
            if now - last_report >= self._report_every_s:
                last_report = now
                logger.warning("kvpersist: a preempted request's KV blocks are held: the LMCache "
                               "server (%s) has not read %d store(s) for %.0fs; vLLM waits until "
                               "it answers or exits", fallback or "process unknown",
                               len(pending), now - began)
            _wait(pending[0], POLL_S)
        self.waited_s += self._clock() - began

    def _gone(self, server: ServerProcess | None) -> bool:
        if server is not None:
            return server.gone()
        return self._url is not None and self._refuses(self._url)


def _wait(future: Any, timeout: float) -> None:
    try:
        future.wait(timeout=timeout)
    except Exception:  # a failed wait is judged by query() on the next round
        time.sleep(min(timeout, 0.05))
