"""The scheduler's part of kvpersist's connector: when a lookup is abandoned, and what an
abandoned lookup leaves behind.

vLLM builds one connector per process and role; in the scheduler's this object holds the state
only the scheduler has (the lookup deadlines, the progress probe, the late-attach watch), as
vLLM's own ``OffloadingConnectorScheduler`` does.  The worker's part is
:mod:`kvpersist.serving.connector.worker.side`.

Invariants
----------
* A lookup is abandoned, and the request bypasses the cache (recomputed, nothing stored), when
  the heartbeat says the server is down, after ``kvpersist.lookup_timeout_s`` without progress,
  or after ``kvpersist.lookup_max_s`` in all (:mod:`kvpersist.serving.connector.scheduler.lookup_deadline`).
* Until a late-attaching engine has attached, no lookup is made (no hit is promised) and no
  store is sent.  An engine whose workers' registrations went unanswered at start is such an
  engine from the handshake on (:meth:`SchedulerSide.attach_when_registered`).
* While the heartbeat says the server is down, stores are dropped from the step's metadata
  (unless LMCache's lazy offload expects one receipt per store) and counted in ``/metrics``.
* An abandoned lookup's L1 locks are released on a live server (a courtesy: the read-lock TTL
  is the backstop).
* LMCache's answer of 0 hits counts only while its heartbeat says the server is healthy: its own
  health check answers 0 without asking the server, so a 0 given while unhealthy (the beat was
  missed between kvpersist's check and LMCache's) is not an answer; the request waits, under the
  deadline, and asks again.
* **Weights that change at run time end caching at that moment.**  Before any collective RPC
  that may change the weights runs (:mod:`kvpersist.serving.lmcache_compat.engine_rpc`), every
  tracked request stops storing, no lookup is made from then on (a request already keyed
  bypasses), and the step's stores are dropped, counted as ``weights_changed``; the namespace
  names weights the engine no longer runs, until it restarts.
* Every request LMCache tracks is keyed before LMCache uses its tracker: its salt is the one
  :mod:`kvpersist.serving.connector.request_keys` derives (the LoRA adapter's content folded in), or, when
  its KV cannot be keyed exactly, it is neither looked up nor stored (``max_offload_tokens`` 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ....config.client import ConnectorOptions
from ....identity import CacheIdentity
from ... import http
from ...lmcache_compat import adapters as lmcache_adapters
from ...lmcache_compat import status as server_status
from ..heartbeat import dead_after_s
from ..metrics import KvPersistConnectorStats
from ..request_keys import RequestKey, RequestKeys, Uncacheable
from .late_attach import RegistrationWatch
from .lookup_deadline import LookupDeadline, ServerProgressProbe

logger = logging.getLogger("vllm.kvpersist.connector")

LookupResult = tuple[int | None, bool]
#: The reason label of requests and stores given up because the weights may have changed.
WEIGHTS_CHANGED = "weights_changed"



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


class SchedulerSide:
    """kvpersist's state in the scheduler's connector (see module invariants)."""

    def __init__(self, connector: Any, options: ConnectorOptions, identity: CacheIdentity,
                 stats: KvPersistConnectorStats, *, workers: int, attach_late: bool,
                 keys: RequestKeys | None = None) -> None:
        self._connector = connector
        self.keys = keys if keys is not None else RequestKeys(None)
        self._adapter = connector.scheduler_adapter
        self._stats = stats
        self.deadline = LookupDeadline(
            options.lookup_timeout_s, options.lookup_max_s,
            dead_after_s=dead_after_s(lmcache_adapters.heartbeat_interval_s(self._adapter)))
        self._server_gone = GoneCache(options.http_url)
        self._probe: ServerProgressProbe | None = None
        self._watch: RegistrationWatch | None = None
        #: Why the weights may have changed since the engine started (None: they have not).
        self.weights_changed_by: str | None = None
        #: The adapter id of each tracked request that has one.
        self._adapter_of: dict[str, int] = {}
        self.keys.on_adapter_void = self.adapter_void
        self._status_url: str | None = None
        self._identity, self._workers = identity, workers
        if options.http_url:
            self._status_url = options.http_url.rstrip("/") + server_status.PATH
            self._probe = ServerProgressProbe(self._status_url, self.deadline)
            if attach_late:
                self.attach_when_registered()
        if attach_late:
            lmcache_adapters.start_scheduler_unhealthy(self._adapter)

    @property
    def attached(self) -> bool:
        return self._watch is None or self._watch.attached

    def attach_when_registered(self) -> bool:
        """From now until the server's ``/status`` lists this engine's namespace registered by
        all its workers, no lookup is made and nothing is stored (see module invariants).
        False when there is no ``/status`` to watch (the caller closes the gate instead)."""
        if self._status_url is None:
            return False
        if self._watch is None:
            self._watch = RegistrationWatch(self._status_url, self._identity.namespace,
                                            workers=self._workers)
        return True

    def lookup(self, request: Any, lmcache_lookup: Callable[[], LookupResult]) -> LookupResult:
        """LMCache's lookup (``lmcache_lookup``) under the deadline; ``(0, False)`` when the
        request bypasses, ``(None, False)`` while it waits for a live server."""
        rid = request.request_id
        tracker = lmcache_adapters.tracker_of(self._connector, request)  # keyed (key_tracker)
        uncacheable = lmcache_adapters.tracker_mark(tracker)
        if self.weights_changed_by is not None and not isinstance(uncacheable, Uncacheable):
            if self._skip(request):  # keyed under the old weights: no lookup now
                self._stats.record_uncached(WEIGHTS_CHANGED)
            return 0, False
        if isinstance(uncacheable, Uncacheable):
            if lmcache_adapters.is_fresh(tracker):
                self._stats.record_uncached(uncacheable.reason)
                lmcache_adapters.finish_bypass(tracker)
            return 0, False
        if not self.attached:  # an engine started before the server: computed, no lookup
            self._skip(request)
            return 0, False
        self.deadline.begin(rid)
        healthy = bool(self._adapter.is_healthy)
        verdict = self.deadline.verdict(rid, healthy=healthy,
                                        gone=not healthy and self._server_gone())
        if verdict is not None:
            why = verdict.text
            if self._probe is not None:
                why += f"; {self._probe.describe()}"
            self._bypass(request, why, verdict.reason)
            return 0, False
        if not healthy:
            # Missed beats of a live server: LMCache would answer 0 hits and drop the lookup;
            # the deadline above decides when it is dead (a refused socket, or unhealthy for
            # dead_after_s without progress).  Until then the request waits.
            return None, False
        result = lmcache_lookup()
        if result[0] == 0 and not self._adapter.is_healthy:
            # The heartbeat turned unhealthy between the check above and LMCache's own (a
            # missed beat of a busy server): LMCache then answers 0 without asking the server,
            # and a restore in progress would be thrown away.  Not an answer: the request
            # waits, and the deadline decides as for any unhealthy wait.
            return None, False
        if result[0] is not None:
            self.deadline.end(rid)
        return result

    def key_tracker(self, request: Any, tracker: Any) -> None:
        """Give LMCache's new ``tracker`` of ``request`` its key: the derived salt, or no
        lookup and no store at all (see module invariants).  Once per tracker."""
        if lmcache_adapters.tracker_mark(tracker) is not None:
            return
        key: RequestKey | Uncacheable
        try:
            key = (self.keys.key(request) if self.weights_changed_by is None
                   else self._weights_uncacheable())
            if isinstance(key, RequestKey) and key.item_digests is not None:
                lmcache_adapters.key_items_by_content(tracker, request, key.item_digests)
        except Exception as exc:  # a request kvpersist cannot key is a miss, never a crash
            logger.exception("kvpersist: request %s cannot be keyed; it is neither looked up "
                             "nor stored", request.request_id)
            key = Uncacheable("key_error", f"{type(exc).__name__}: {exc}")
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            self._adapter_of[request.request_id] = int(getattr(lora, "lora_int_id", 0))
        if isinstance(key, Uncacheable):
            lmcache_adapters.store_nothing(tracker)
            lmcache_adapters.mark_tracker(tracker, key)
        else:
            lmcache_adapters.set_tracker_salt(tracker, key.salt)
            lmcache_adapters.mark_tracker(tracker, key.salt)

    def _weights_uncacheable(self) -> Uncacheable:
        return Uncacheable(WEIGHTS_CHANGED, f"the engine's weights may have changed at run time "
                           f"({self.weights_changed_by}): nothing is cached until it restarts")

    def weights_changed(self, how: str) -> None:
        """The engine is about to run ``how``, which may change its weights: from now on no
        request is looked up or stored (see module invariants)."""
        if self.weights_changed_by is None:
            self.weights_changed_by = how
            logger.error("kvpersist: collective RPC %r may change the engine's weights: no KV "
                         "is looked up or stored from now until vLLM restarts (the namespace "
                         "names the weights it started with)", how)
        for tracker in lmcache_adapters.trackers(self._connector):
            lmcache_adapters.store_nothing(tracker)

    def adapter_void(self, adapter_id: int) -> None:
        """Adapter ``adapter_id`` may now run weights no digest describes: requests keyed
        with it before store nothing more."""
        for tracker in lmcache_adapters.trackers(self._connector):
            if self._adapter_of.get(tracker.request_id) == adapter_id:
                lmcache_adapters.store_nothing(tracker)

    def drop_stores_after_weight_change(self, metadata: Any) -> None:
        """Remove the step's stores once the weights may have changed (belt and braces: the
        trackers already store nothing)."""
        if self.weights_changed_by is None:
            return
        self._drop_stores(metadata, WEIGHTS_CHANGED)

    def finished(self, request: Any) -> None:
        self.deadline.end(request.request_id)
        self._adapter_of.pop(request.request_id, None)

    def drop_stores_while_down(self, metadata: Any, lazy_offload: bool) -> None:
        """Remove the step's stores from ``metadata`` while the heartbeat says the server is
        down: a worker would otherwise block up to ``lmcache.mp.mq_timeout`` twice (prepare
        and commit) per store sent to a dead server before its own heartbeat notices."""
        if self._adapter.is_healthy or lazy_offload:
            return
        self._drop_stores(metadata, "server_down")

    def _drop_stores(self, metadata: Any, reason: str) -> None:
        """Remove every store from the step's ``metadata``, counted under ``reason``."""
        requests = getattr(metadata, "requests", [])
        kept = [r for r in requests if getattr(r, "direction", None) != "STORE"]
        if len(kept) != len(requests):
            self._stats.record_dropped_stores(reason, len(requests) - len(kept))
            metadata.requests = kept

    def _skip(self, request: Any) -> bool:
        """Mark ``request`` as bypassing LMCache (no load, no store); False if it already was."""
        rid = request.request_id
        self.deadline.end(rid)
        tracker = lmcache_adapters.mark_bypassed(self._connector, request)
        if tracker is None:
            return False
        self._adapter.cleanup_lookup_result(rid)
        self._release_lookup(request, tracker)
        lmcache_adapters.finish_bypass(tracker)
        return True

    def _release_lookup(self, request: Any, tracker: Any) -> None:
        """Tell a live server that a lookup is given up, so that it returns the L1 buffers
        the lookup's prefetch holds (at once, or when a running load ends) instead of after the
        read-lock TTL.  Nothing is sent to a server the heartbeat calls down."""
        adapter = self._adapter
        if not adapter.is_healthy or not self.attached:
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

    def _bypass(self, request: Any, why: str, reason: str) -> None:
        if not self._skip(request):
            return
        self._stats.record_bypass(reason)
        logger.warning("kvpersist: request %s bypasses the KV cache (%s); it is recomputed",
                       request.request_id, why)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        if self._watch is not None:
            self._watch.close()
