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
* **A finished request's blocks are freed only after its last store settled.**  vLLM frees them
  when the worker reports the request "finished sending" (``get_finished``).  LMCache 0.5.6
  reports a request there as soon as *any* earlier store of it settled: the id stays in its
  ``finished_stores`` set from that earlier store, while ``store_futures`` holds the later one
  still in flight (a request stores once per prefill step that completes a chunk).  A server
  that reads the last prefill step's store after the request's decode steps ended would read
  blocks vLLM may have given another request, and publish that KV under this one's key.  Found
  by reading LMCache 0.5.6 (its own code, run in ``tests/serving/test_store_fence.py``, reports
  such a request); no wrong chunk of this kind was seen.  The fence withholds such a request
  from the report until that future settles or its server process is gone, and reports it
  then; nothing else of LMCache's result changes.

Installed per worker adapter instance: it replaces the adapter's ``handle_preemptions`` and calls
nothing of LMCache's flush, and wraps the ``get_finished`` installed before it (feature
``store_fence`` pins both).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ... import http
from ...lmcache_compat import adapters as lmcache_adapters
from ...lmcache_compat.adapters import future_settled
from .server_process import ServerProcess, listener_of

logger = logging.getLogger("vllm.kvpersist.store_fence")
Clock = Callable[[], float]
#: How long one wait on a store's reply lasts before the server's process is looked at again.
POLL_S = 0.2
#: How often withheld finished requests are checked for a gone server (a live server settles
#: them by answering; the check only frees the blocks of stores nobody will answer).
GONE_CHECK_S = 1.0


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
        self.finishes_withheld = 0  # finished requests held back for a store in flight
        self._withheld: dict[str, Any] = {}  # request id -> its last store's future
        self._gone_checked_at = float("-inf")

    def install(self) -> None:
        """Route the adapter's ``handle_preemptions`` through the fence, and its ``get_finished``
        (as installed so far: the load fence's) through :meth:`finished`."""
        original = type(self._adapter).handle_preemptions
        self._adapter.handle_preemptions = functools.partial(self._handle_preemptions, original)
        self._adapter.get_finished = functools.partial(self.finished,
                                                       self._adapter.get_finished)

    def finished(self, inner: Callable[..., Any], *args: Any
                 ) -> tuple[set[str] | None, set[str] | None]:
        """``inner(*args)`` (LMCache's ``get_finished``), with every request reported finished
        sending whose last store has not settled held back, and reported by a later call once
        it has (or its server process is gone)."""
        before = lmcache_adapters.store_futures(self._adapter)  # a copy: LMCache pops settled ones
        sending, receiving = inner(*args)
        after = lmcache_adapters.store_futures(self._adapter)
        out = set(sending or ())
        for rid in list(out):
            future = after.get(rid, before.get(rid))
            if future is not None and not future_settled(future):
                out.discard(rid)
                self._withheld[rid] = future
                self.finishes_withheld += 1
                if self.finishes_withheld == 1 or self.finishes_withheld % 100 == 0:
                    logger.info("kvpersist: request %s finished while its last store is still "
                                "being read out of its KV blocks; the blocks are freed once "
                                "the server has read them (%d such requests so far)", rid,
                                self.finishes_withheld)
        out |= self._release()
        return (out or None) if sending is None else out, receiving

    def _release(self) -> set[str]:
        """The withheld requests whose store settled or whose server process is gone."""
        if not self._withheld:
            return set()
        done = {rid for rid, future in self._withheld.items() if future_settled(future)}
        now = self._clock()
        if len(done) < len(self._withheld) and now - self._gone_checked_at >= GONE_CHECK_S:
            self._gone_checked_at = now
            fallback = self._listener(self._url)
            gone = {rid for rid, future in self._withheld.items()
                    if rid not in done and self._gone(self._server_of(future) or fallback)}
            if gone:
                self.given_up += len(gone)
                self._record("server_gone", len(gone))
            done |= gone
        for rid in done:
            del self._withheld[rid]
        return done

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
        pending = [f for f in futures if not future_settled(f)]
        if not pending:
            return
        self.flushes += 1
        servers = {id(f): self._server_of(f) for f in pending}
        fallback = self._listener(self._url)
        began = last_report = self._clock()
        while pending:
            pending = [f for f in pending if not future_settled(f)]
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
