"""A load given up is fenced: vLLM may reuse a block only once no late write can land in it.

In ``lmcache_driven`` mode the LMCache server writes restored KV straight into vLLM's KV memory
(a ``/dev/shm`` segment it maps on CPU, CUDA IPC on a GPU), and reads it from there to store.
LMCache 0.5.6's worker adapter, once its heartbeat misses a beat, reports every transfer in
flight as finished (``get_finished``: restores as failed loads, stores as done).  vLLM then
recomputes into the very blocks the server is still writing, or frees blocks the server is
still reading: a busy server's late write changed the output at TP=2 here.

Invariants
----------
* A transfer in flight is reported to vLLM only when one of these holds:
  - the server settled it (its reply came; on a GPU also its completion event): it is then
    judged by its result, exactly as LMCache judges it with a healthy heartbeat, so a restore
    that a busy server finished while its beats were late is a hit, not a recompute;
  - the process it was sent to is gone
    (:class:`~kvpersist.serving.connector.worker.server_process.ServerProcess`:
    exited, zombie, or its pid now names a later process), or, where that process could not
    be named (a TCP admin URL, another pid namespace), nobody listens at the server's socket:
    it can write no more, and the transfer is reported failed (a recompute).
  A transfer the server neither settled nor can be shown dead to is held: the request waits
  in ``WAITING_FOR_REMOTE_KVS`` with its blocks (vLLM frees an aborted request's blocks only
  after this report), and every other request is served.
* With a healthy heartbeat and no transfer whose server is gone, LMCache's own
  ``get_finished`` runs unchanged; the fence only decides what it is shown.
* A transfer never sent (dropped at submit while unhealthy) is reported at once, as LMCache
  does: it cannot write.
* A load the server answered failed after writing its first chunks keeps those chunks
  (:mod:`kvpersist.serving.connector.worker.served_prefix`): only the blocks from the failed chunk on are
  load errors.
* ``engine_driven`` needs no fence: the worker itself copies a reply into its KV memory, so a
  reply given up (:mod:`kvpersist.serving.connector.worker.transfer_wait`) is never written.

The fence is installed per worker adapter instance; it replaces no LMCache code, it calls
LMCache's own method on a view of the adapter
(:class:`kvpersist.serving.lmcache_compat.adapters.AdapterView`, feature ``load_fence``).
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
from .served_prefix import ServedPrefixKeeper
from .server_process import ServerProcess, listener_of

logger = logging.getLogger("vllm.kvpersist.load_fence")  # inherits vLLM's log handler
Clock = Callable[[], float]
#: Reasons a worker reported a load failed (``vllm:kvpersist_failed_loads_total{reason}``).
FAILED_LOAD_REASONS = ("server_error", "server_gone", "unhealthy_at_submit")
#: How often transfers in flight are checked for a gone server while the heartbeat is healthy
#: (a server restarted faster than a heartbeat notices).
HEALTHY_CHECK_S = 1.0


class LoadFence:
    """The fence of one LMCache worker adapter (see module invariants)."""

    def __init__(self, adapter: Any, *, server_url: str | None,
                 listener: Callable[[str | None], ServerProcess | None] = listener_of,
                 refuses: Callable[[str], bool] = http.refuses_connections,
                 record: Callable[[str, int], None] | None = None,
                 keeper: ServedPrefixKeeper | None = None,
                 clock: Clock = time.monotonic) -> None:
        self._adapter = adapter
        self._keeper = keeper
        self._url = server_url
        self._listener = listener
        self._refuses = refuses
        self._record = record or (lambda reason, count: None)
        self._clock = clock
        # id(future) -> (future, the process it was sent to, or None where it cannot be named)
        self._sent_to: dict[int, tuple[Any, ServerProcess | None]] = {}
        self._gone: set[ServerProcess] = set()
        self._unnamed_gone: set[int] = set()  # transfers of an unnamed server seen refused
        self._held: set[int] = set()  # futures held past an unhealthy heartbeat (logged once)
        self._checked_at = float("-inf")
        self.held_total = 0  # transfers waited for past an unhealthy heartbeat
        self.released_gone = 0  # transfers reported failed because their server was gone

    def install(self) -> None:
        """Route the adapter's ``get_finished`` calls (both variants) through the fence."""
        for name in lmcache_adapters.FINISHED_METHODS:
            original = getattr(type(self._adapter), name, None)
            if original is not None:
                setattr(self._adapter, name, functools.partial(self._finished, original))

    # -- bookkeeping of what is in flight
    def _in_flight(self) -> dict[int, tuple[str, str, Any]]:
        """id(future) -> (kind, request id, future) for every transfer not yet reported."""
        out: dict[int, tuple[str, str, Any]] = {}
        for rid, (future, _blocks) in list(self._adapter.retrieve_futures.items()):
            out[id(future)] = ("retrieve", rid, future)
        for rid, future in list(self._adapter.store_futures.items()):
            out[id(future)] = ("store", rid, future)
        return out

    def _tag(self, flight: dict[int, tuple[str, str, Any]]) -> None:
        """Name the server process of transfers seen for the first time; forget reported ones."""
        for key in [k for k in self._sent_to if k not in flight]:
            del self._sent_to[key]
            self._held.discard(key)
            self._unnamed_gone.discard(key)
        new = [key for key in flight if key not in self._sent_to]
        if new:
            server = self._listener(self._url)
            for key in new:
                self._sent_to[key] = (flight[key][2], server)

    def server_of(self, future: Any) -> ServerProcess | None:
        """The server process ``future`` was seen sent to, or None if it was not tagged (or its
        server could not be named)."""
        tagged = self._sent_to.get(id(future))
        return None if tagged is None else tagged[1]

    def _server_gone(self, key: int) -> bool:
        """Whether the server of transfer ``key`` can write no more.  Sticky: a process once
        gone stays gone, and a transfer whose server was unnamed stays released once its
        socket refused (a later server on the socket never heard of it)."""
        server = self._sent_to[key][1]
        if server in self._gone or key in self._unnamed_gone:
            return True
        if server is not None:
            if server.gone():
                self._gone.add(server)
                return True
        elif self._url is not None and self._refuses(self._url):
            self._unnamed_gone.add(key)
            return True
        return False

    def _orphans(self, flight: dict[int, tuple[str, str, Any]], healthy: bool) -> set[int]:
        """Transfers not settled whose server is gone (looked at every call while unhealthy,
        every ``HEALTHY_CHECK_S`` while healthy)."""
        now = self._clock()
        if healthy and now - self._checked_at < HEALTHY_CHECK_S:
            return set()
        self._checked_at = now
        return {key for key, (_kind, _rid, future) in flight.items()
                if not future_settled(future) and self._server_gone(key)}

    # -- the fenced call
    def _finished(self, original: Callable[..., Any], *args: Any) -> Any:
        adapter = self._adapter
        flight = self._in_flight()
        self._tag(flight)
        healthy = bool(adapter.is_healthy)
        orphans = self._orphans(flight, healthy) if flight else set()
        dropped = lmcache_adapters.dropped_retrieve_count(adapter)
        failed_before = lmcache_adapters.failed_request_ids(adapter)
        # block lists by reference, only where a failed load may keep its served part
        retrieving = ({rid: blocks for rid, (_f, blocks) in list(adapter.retrieve_futures.items())}
                      if self._keeper is not None else {})
        if healthy and not orphans:
            result = original(adapter, *args)
            self._count_failed(failed_before, dropped)
            self._keep_served(retrieving, failed_before)
            return result
        if not healthy:
            self._note_held(flight, orphans)
        settled = original(lmcache_adapters.healthy_view(adapter), *args)
        self._count_failed(failed_before, dropped)
        self._keep_served(retrieving, failed_before)
        if not orphans:
            return settled
        drained = self._drain(original, flight, orphans, args)
        return _merge(settled, drained)

    def _note_held(self, flight: dict[int, tuple[str, str, Any]], orphans: set[int]) -> None:
        for key, (kind, rid, future) in flight.items():
            if key in orphans or key in self._held or future_settled(future):
                continue
            self._held.add(key)
            self.held_total += 1
            logger.warning(
                "kvpersist: the heartbeat calls the LMCache server unhealthy while a %s of "
                "request %s is in flight in vLLM's KV memory (%s); its blocks are held until the "
                "server answers or exits", kind, rid, self._sent_to[key][1] or "server process "
                "unknown: held until its socket refuses")

    def _keep_served(self, retrieving: dict[str, list[int]], failed_before: set[str]) -> None:
        """Loads the server just answered failed keep the chunks it served
        (:mod:`kvpersist.serving.connector.worker.served_prefix`); loads of a gone server never reach here."""
        if self._keeper is None:
            return
        failed = {rid: retrieving[rid] for rid in lmcache_adapters.failed_request_ids(self._adapter)
                  - failed_before if rid in retrieving}
        if failed:
            self._keeper.keep(failed)

    def _count_failed(self, failed_before: set[str], dropped: int) -> None:
        """Record what LMCache's method just reported failed: ``dropped`` loads never sent, the
        rest failed by the server's own answer."""
        new = len(lmcache_adapters.failed_request_ids(self._adapter) - failed_before)
        if dropped:
            self._record("unhealthy_at_submit", dropped)
        if new - dropped > 0:
            self._record("server_error", new - dropped)

    def _drain(self, original: Callable[..., Any], flight: dict[int, tuple[str, str, Any]],
               orphans: set[int], args: tuple[Any, ...]) -> Any:
        """LMCache's unhealthy branch, shown only the transfers whose server is gone."""
        adapter = self._adapter
        retrieves = {flight[k][1] for k in orphans if flight[k][0] == "retrieve"}
        stores = {flight[k][1] for k in orphans if flight[k][0] == "store"}
        result = original(lmcache_adapters.drain_view(adapter, retrieves, stores), *args)
        lmcache_adapters.forget_transfers(adapter, retrieves, stores)
        self.released_gone += len(orphans)
        if retrieves:
            self._record("server_gone", len(retrieves))
        servers = sorted({str(self._sent_to[k][1] or "its socket refuses") for k in orphans})
        logger.warning("kvpersist: the LMCache server of %d transfer(s) in flight is gone (%s): "
                       "%d restore(s) recomputed, %d store(s) dropped; nothing more can be "
                       "written into their blocks", len(orphans), ", ".join(servers),
                       len(retrieves), len(stores))
        return result


def _merge(first: Any, second: Any) -> tuple[set[str] | None, set[str] | None]:
    """Union of two ``(sending, receiving)`` results, where None means "nothing"."""
    def union(a: set[str] | None, b: set[str] | None) -> set[str] | None:
        if a is None and b is None:
            return None
        return set(a or ()) | set(b or ())

    sending = union(first[0], second[0])
    receiving = union(first[1], second[1])
    if sending is not None and receiving:
        sending -= receiving  # a request's receive is reported first (see LMCache's drain)
    return sending, receiving
