"""The L1 window's counters on the LMCache server's ``/metrics`` (OpenTelemetry instruments on
the global meter, as :mod:`kvpersist.l2.metrics` does for the store).

Prometheus names (the exporter adds ``_total``): ``kvpersist_restore_streamed`` (restores that
streamed through L1), ``kvpersist_restore_streamed_chunks`` / ``..._streamed_bytes``,
``kvpersist_restore_evicted_on_demand`` / ``..._evicted_on_demand_bytes`` (clean L1 objects
evicted to make room), ``kvpersist_restore_released_abandoned`` (abandoned lookups settled in
the background), and ``kvpersist_restore_cut_short{reason}`` with
``kvpersist_restore_cut_short_tokens{reason}``: restores that delivered less than the prefix L1
and L2 held, by reason (``l1_full``: L1 could not take it even after evicting clean objects;
``load_failed``: a file did not load or verify; ``stream_failed``: a streamed window did not).

Invariant: values are read from the window's snapshot at scrape time; nothing is counted here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

METER = "kvpersist.restore"
_PLAIN = {
    "kvpersist_restore.streamed": ("Restores that streamed through L1", "streamed_restores"),
    "kvpersist_restore.streamed_chunks": ("Chunks loaded by streamed windows",
                                          "streamed_columns"),
    "kvpersist_restore.streamed_bytes": ("Bytes loaded by streamed windows", "streamed_bytes"),
    "kvpersist_restore.evicted_on_demand": ("Clean L1 objects evicted to make room",
                                            "evicted_objects"),
    "kvpersist_restore.evicted_on_demand_bytes": ("Bytes of clean L1 objects evicted",
                                                  "evicted_bytes"),
    "kvpersist_restore.released_abandoned": ("Abandoned lookups released when their load ended",
                                             "released_abandoned"),
}
_BY_REASON = {
    "kvpersist_restore.cut_short": ("Restores that got less than the prefix L1 and L2 held",
                                    "cut_short"),
    "kvpersist_restore.cut_short_tokens": ("Tokens recomputed by restores cut short",
                                           "cut_short_tokens"),
}


class _Source:
    snapshot: Callable[[], dict[str, Any]] | None = None
    registered = False


def bind(snapshot: Callable[[], dict[str, Any]]) -> bool:
    """Make the instruments read ``snapshot()``; False without OpenTelemetry."""
    _Source.snapshot = snapshot
    if _Source.registered:
        return True
    try:
        from opentelemetry import metrics
    except ImportError:
        return False
    meter = metrics.get_meter(METER)

    def read() -> dict[str, Any]:
        source = _Source.snapshot
        if source is None:
            return {}
        try:
            return source()
        except Exception:  # a scrape never breaks the server
            logger.exception("kvpersist: reading the restore counters failed")
            return {}

    def plain(field: str) -> Callable[[Any], list[Any]]:
        return lambda _options: [metrics.Observation(read().get(field, 0), {})]

    def by_reason(field: str) -> Callable[[Any], list[Any]]:
        return lambda _options: [metrics.Observation(n, {"reason": r})
                                 for r, n in read().get(field, {}).items()]

    for name, (doc, field) in _PLAIN.items():
        meter.create_observable_counter(name, callbacks=[plain(field)], description=doc)
    for name, (doc, field) in _BY_REASON.items():
        meter.create_observable_counter(name, callbacks=[by_reason(field)], description=doc)
    _Source.registered = True
    return True
