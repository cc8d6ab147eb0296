"""The LMCache server's ``GET /status``, read in one place.

``/status`` is LMCache's own document, not a stable API: every key kvpersist reads from it is
named here, so a renamed key is one edit (and fails ``tests/serving/test_lmcache_compat.py``,
which reads a live server's document).

Invariants
----------
* Every reader accepts any JSON value: a missing or malformed section reads as empty (no
  registrations, no progress, no adapter); nothing here raises on the document's shape.
* No LMCache import: ``kvp-admin`` reads ``/status`` on hosts without LMCache.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ...identity.fields import NAMESPACE_IN_TEXT
from .. import http

PATH = "/status"
#: The sections that list registered engines (CUDA and CPU transfer contexts).
REGISTRATION_SECTIONS = ("cache_context_meta", "non_cuda_context_meta")
#: ``type`` of kvpersist's adapter among ``storage_manager.l2_adapters``.
KVPERSIST_ADAPTER = "KvPersistL2Adapter"



def fetch(http_url: str, timeout: float = 5.0) -> Mapping[str, Any] | None:
    """The server's ``/status`` document, or None when it does not answer with a JSON object."""
    return http.get_object(http_url.rstrip("/") + PATH, timeout=timeout)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def storage_manager(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(status.get("storage_manager"))


def l2_adapters(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Each L2 adapter's ``report_status``, in the server's order."""
    adapters = storage_manager(status).get("l2_adapters")
    return [a for a in adapters if isinstance(a, Mapping)] if isinstance(adapters, list) else []


def kvpersist_adapters(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``report_status`` of every kvpersist adapter the server runs."""
    return [a for a in l2_adapters(status) if a.get("type") == KVPERSIST_ADAPTER]


def store_controllers(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for c in _mapping(storage_manager(status).get("store_controllers")).values()
            if isinstance(c, Mapping)]


def l2_eviction_adapters(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    adapters = _mapping(storage_manager(status).get("l2_eviction_controller")).get("adapters")
    return [a for a in adapters if isinstance(a, Mapping)] if isinstance(adapters, list) else []


def progress_token(status: Mapping[str, Any]) -> tuple[float, ...]:
    """The counters that move while a restore progresses: bytes the L2 adapters read and
    loaded, L1 bytes in use or staged, and the prefetch controller's completed results and
    loads in progress."""
    manager = storage_manager(status)
    adapters = l2_adapters(status)
    l1 = [m for m in _mapping(manager.get("l1_managers")).values() if isinstance(m, Mapping)]
    prefetch = _mapping(manager.get("prefetch_controller"))

    def number(value: Any) -> float:
        return float(value) if isinstance(value, (int, float)) else 0.0

    return (
        sum(number(a.get("read_bytes")) for a in adapters),
        sum(number(a.get("loaded_bytes")) for a in adapters),
        sum(number(m.get("memory_used_bytes")) + number(m.get("staging_bytes")) for m in l1),
        number(prefetch.get("completed_results_count")),
        number(prefetch.get("load_phase_count")),
    )


def registered_namespaces(status: Mapping[str, Any]) -> Counter[str]:
    """Namespace -> how many registered engine contexts (one per worker) carry it."""
    found: Counter[str] = Counter()
    for section in REGISTRATION_SECTIONS:
        for entry in _mapping(status.get(section)).values():
            found.update(set(NAMESPACE_IN_TEXT.findall(json.dumps(entry))))
    return found


def registrations(status: Mapping[str, Any], namespace: str) -> int:
    """How many registered engine contexts carry ``namespace``."""
    return registered_namespaces(status)[namespace]
