"""An engine started before the cache server serves uncached, then attaches when the server answers.

LMCache's MP adapters ask the server for its chunk size when they are built and register the
worker's KV caches with it at start; without a server, both block and then fail.  LMCache's
heartbeat already knows how to come back from a server that was away: on the unhealthy ->
healthy edge the worker re-registers its KV caches.  Late attach reuses that path:

* the adapters are built with the chunk size the server will have (``kvpersist.chunk_size``,
  which the launcher takes from the same settings as the server) instead of asking for it;
* they start *unhealthy* with their heartbeat running; the worker's first registration is
  deferred to the heartbeat's recovery callback, which sends it once the server answers;
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

import contextlib
import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import http

logger = logging.getLogger("vllm.kvpersist.late_attach")

#: The /status sections that list registered engines (CUDA and CPU transfer contexts).
REGISTRATION_SECTIONS = ("cache_context_meta", "non_cuda_context_meta")


@contextlib.contextmanager
def chunk_size_without_server(chunk_size: int) -> Iterator[None]:
    """Within the block, LMCache's adapters take ``chunk_size`` instead of asking the server.
    Used only around the connector's construction (vLLM builds connectors one at a time)."""
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapters

    original = adapters.get_lmcache_chunk_size

    def known(_client: Any, timeout: float | None = None) -> int:
        return chunk_size

    adapters.get_lmcache_chunk_size = known
    try:
        yield
    finally:
        adapters.get_lmcache_chunk_size = original


def start_scheduler_unhealthy(adapter: Any) -> None:
    """Mark every server unhealthy and start the heartbeat that will notice it answering."""
    for event in adapter._health_events.values():
        event.clear()
    adapter._ensure_heartbeat_started()


def defer_worker_registration(adapter: Any) -> None:
    """The worker's first KV-cache registration is kept for the heartbeat's recovery callback
    (LMCache's own re-registration path) instead of being sent to a server that is not there."""
    adapter._health_event.clear()

    def deferred(kv_caches: Any) -> None:
        adapter.kv_caches = kv_caches
        del adapter._send_register_kv_caches_request  # the class's method from now on
        adapter._ensure_heartbeat_started()
        logger.warning("kvpersist: KV caches kept for registration once the LMCache server "
                       "answers (worker %s)", getattr(adapter, "instance_id", "?"))

    adapter._send_register_kv_caches_request = deferred


_NAMESPACE = re.compile(r"kvp-[0-9a-f]{32}")


def registered_namespaces(status: Mapping[str, Any]) -> Counter[str]:
    """Namespace -> how many engine contexts registered with the server carry it, read from a
    server ``/status`` (one count per worker; ``kvp-admin`` reads the active set from it)."""
    found: Counter[str] = Counter()
    for section in REGISTRATION_SECTIONS:
        entries = status.get(section)
        if isinstance(entries, Mapping):
            for entry in entries.values():
                found.update(set(_NAMESPACE.findall(json.dumps(entry))))
    return found


def registrations(status: Mapping[str, Any], namespace: str) -> int:
    """How many registered engine contexts in a server ``/status`` carry ``namespace``."""
    return registered_namespaces(status)[namespace]


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
            self._attached.set()
            logger.warning("kvpersist: late attach: the LMCache server lists namespace %s "
                           "for all %d worker(s); caching ON", self.namespace, self.workers)
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
