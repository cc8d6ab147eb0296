"""An engine started before the cache server serves uncached, then attaches when the server answers.

LMCache's MP adapters ask the server for its chunk size when they are built and register the
worker's KV caches with it at start; without a server, both block and then fail.  LMCache's
heartbeat already knows how to come back from a server that was away: on the unhealthy ->
healthy edge the worker re-registers its KV caches.  Late attach reuses that path:

* the adapters are built with the chunk size the server will have (``kvpersist.chunk_size``,
  which the launcher takes from the same settings as the server) instead of asking for it;
* they start *unhealthy* with their heartbeat running; the worker's first registration is
  deferred to the heartbeat's recovery callback, which sends it once the server answers (these
  two reach into LMCache's adapters: :mod:`kvpersist.serving.lmcache_compat.adapters`, feature
  ``late_attach``);
* the scheduler attaches only when the server's ``/status`` lists this engine's namespace
  registered by as many workers as the engine has (:class:`RegistrationWatch`).

Invariants
----------
* Until the scheduler has attached it never looks up (so it promises no hit) and sends no store;
  each request is computed as without a cache.
* No hit is promised before the worker side is registered: attaching waits for the server to
  report the registrations.  Should a worker drop out again afterwards, LMCache's ordinary
  unhealthy path (and vLLM's ``kv_load_failure_policy=recompute``) applies.
* Nothing here blocks vLLM's scheduler loop: the watch is a daemon thread with a timeout on
  every request; the scheduler reads one flag.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ... import http
from ...lmcache_compat.status import registrations

logger = logging.getLogger("vllm.kvpersist.late_attach")


class RegistrationWatch:
    """Polls the server's ``/status`` until ``workers`` registrations of ``namespace`` are
    listed; then :attr:`attached` turns true (once, for good) and ``on_attach`` runs."""

    def __init__(self, status_url: str, namespace: str, workers: int, *,
                 interval_s: float = 1.0, timeout_s: float = 2.0,
                 fetch: Callable[[str, float], Mapping[str, Any] | None] | None = None,
                 on_attach: Callable[[], None] | None = None) -> None:
        self.status_url = status_url
        self.namespace = namespace
        self.workers = workers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._fetch = fetch or (lambda url, timeout: http.get_object(url, timeout=timeout))
        self._on_attach = on_attach
        self._attached = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpersist-late-attach",
                                        daemon=True)
        self._thread.start()

    @property
    def attached(self) -> bool:
        return self._attached.is_set()

    def wait(self, timeout: float) -> bool:
        return self._attached.wait(timeout)

    def poll_once(self) -> bool:
        status = self._fetch(self.status_url, self.timeout_s)
        if status is not None and registrations(status, self.namespace) >= self.workers:
            logger.warning("kvpersist: late attach: the LMCache server lists namespace %s "
                           "for all %d worker(s); caching ON", self.namespace, self.workers)
            self._attached.set()
            if self._on_attach is not None:
                self._on_attach()
        return self.attached

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.poll_once():
                    return
            except Exception:  # the watch must never die silently; try again
                logger.exception("kvpersist: late-attach poll failed")
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
