"""The L2 store's counters as Prometheus metrics of the LMCache server (``/metrics``).

LMCache exports its metrics through OpenTelemetry's Prometheus reader; instruments created on
the global meter provider appear on the same ``/metrics`` page, so an L2 adapter living in the
server process needs no port or exporter of its own.

Invariants
----------
* Every value is read from :meth:`KvFileStore.status` at scrape time (observable instruments):
  nothing is counted twice and nothing here can fall out of step with ``/status``.
* The Grafana dashboard's test checks the names its queries use against a live server's page.
* Without OpenTelemetry installed, registering is a no-op (metrics are optional, data is not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

METER = "kvpersist.l2"

#: Counter name (OTel) -> (description, status key(s) -> label values).
_COUNTERS: dict[str, tuple[str, dict[str, dict[str, str]]]] = {
    "kvpersist_l2.stores": ("Objects published to L2", {"stores": {}}),
    "kvpersist_l2.stored_bytes": ("Bytes published to L2", {"stored_bytes": {}}),
    "kvpersist_l2.rejected_stores": ("Stores refused, by reason", {
        "rejected_capacity": {"reason": "capacity"},
        "rejected_scanning": {"reason": "scanning"},
        "rejected_disk_full": {"reason": "disk_full"},
        "store_errors": {"reason": "error"}}),
    "kvpersist_l2.loads": ("Objects asked of L2, by result", {
        "load_hits": {"result": "hit"}, "load_misses": {"result": "miss"}}),
    "kvpersist_l2.loaded_bytes": ("Verified bytes loaded from L2 into L1", {"loaded_bytes": {}}),
    "kvpersist_l2.verify_failures": ("Reads that failed the check", {"verify_failures": {}}),
    "kvpersist_l2.quarantined": ("Files moved to quarantine", {"quarantined": {}}),
    "kvpersist_l2.evicted": ("Files evicted by the budget", {"evicted": {}}),
}
_GAUGES: dict[str, tuple[str, str]] = {
    "kvpersist_l2.used_bytes": ("Bytes of published L2 files", "used_bytes"),
    "kvpersist_l2.capacity_bytes": ("The L2 budget (hard cap)", "capacity_bytes"),
    "kvpersist_l2.files": ("Published L2 files", "files"),
    "kvpersist_l2.quarantine_files": ("Files in quarantine now", "quarantine_files"),
}


class _Source:
    """The status function of the adapter the instruments read (one adapter per server)."""

    status: Callable[[], dict[str, Any]] | None = None
    registered = False


def bind(status: Callable[[], dict[str, Any]] | None) -> bool:
    """Make the metrics read ``status()`` (None: report nothing).  The instruments are created
    once per process; False when OpenTelemetry is not installed."""
    _Source.status = status
    if _Source.registered:
        return True
    try:
        from opentelemetry import metrics
    except ImportError:
        return False
    meter = metrics.get_meter(METER)

    def observe(points: Callable[[dict[str, Any]], Iterable[tuple[float, dict[str, str]]]]
                ) -> Callable[[Any], list[Any]]:
        def callback(_options: Any) -> list[Any]:
            source = _Source.status
            if source is None:
                return []
            try:
                current = source()
            except Exception:  # a scrape never breaks the server
                logger.exception("kvpersist: reading the store status for /metrics failed")
                return []
            return [metrics.Observation(value, attrs) for value, attrs in points(current)]
        return callback

    def counter_points(keys: dict[str, dict[str, str]]
                       ) -> Callable[[dict[str, Any]], list[tuple[float, dict[str, str]]]]:
        return lambda s: [(s.get(k, 0), attrs) for k, attrs in keys.items()]

    def gauge_points(key: str) -> Callable[[dict[str, Any]], list[tuple[float, dict[str, str]]]]:
        return lambda s: [(s.get(key, 0), {})]

    def by_reason(s: dict[str, Any]) -> list[tuple[float, dict[str, str]]]:
        return [(n, {"reason": r}) for r, n in s.get("verify_failures_by_reason", {}).items()]

    for name, (doc, keys) in _COUNTERS.items():
        meter.create_observable_counter(name, callbacks=[observe(counter_points(keys))],
                                        description=doc)
    meter.create_observable_counter(
        "kvpersist_l2.verify_failures_by_reason", callbacks=[observe(by_reason)],
        description="Reads that failed the check, by reason (a series once a reason occurred)")
    for name, (doc, key) in _GAUGES.items():
        meter.create_observable_gauge(name, callbacks=[observe(gauge_points(key))],
                                      description=doc)
    _Source.registered = True
    return True
