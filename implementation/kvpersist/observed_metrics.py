"""Prometheus metrics of the LMCache server read at scrape time from one snapshot function.

LMCache exports its metrics through OpenTelemetry's Prometheus reader; instruments created on
the global meter provider appear on the same ``/metrics`` page, so code living in the server
process (the L2 adapter, the L1 window) needs no port or exporter of its own.

Invariants
----------
* Values are read from the bound snapshot at scrape time (observable instruments): nothing is
  counted here, so nothing can fall out of step with the snapshot.
* The instruments of one :class:`ObservedMetrics` are created once per process; a later
  :meth:`~ObservedMetrics.bind` only swaps the snapshot they read.
* A missing or failing snapshot yields no points and never breaks a scrape (it is logged).
* Without OpenTelemetry installed, binding is a no-op that returns False (metrics are
  optional, data is not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

Snapshot = Callable[[], dict[str, Any]]
#: A snapshot -> the (value, labels) points of one instrument.
Points = Callable[[dict[str, Any]], Iterable[tuple[float, dict[str, str]]]]


def fields(keys: Mapping[str, Mapping[str, str]]) -> Points:
    """One point per snapshot key (missing: 0), with that key's labels."""
    return lambda s: [(s.get(k, 0), dict(labels)) for k, labels in keys.items()]


def field(key: str) -> Points:
    """The snapshot's ``key`` (missing: 0), without labels."""
    return fields({key: {}})


def by_label(key: str, label: str) -> Points:
    """One point per entry of the mapping at ``key``, labelled ``label=<entry>`` (a series
    appears once its entry does)."""
    return lambda s: [(n, {label: str(v)}) for v, n in (s.get(key) or {}).items()]


class ObservedMetrics:
    """The observable counters and gauges of meter ``meter``, read from one snapshot."""

    def __init__(self, meter: str, what: str, counters: Mapping[str, tuple[str, Points]],
                 gauges: Mapping[str, tuple[str, Points]] | None = None) -> None:
        self.meter = meter
        self.what = what  # for the log line of a failed scrape
        self.counters = dict(counters)
        self.gauges = dict(gauges or {})
        self._snapshot: Snapshot | None = None
        self._registered = False

    def read(self) -> dict[str, Any] | None:
        """The snapshot now, or None (unbound, or it failed: logged)."""
        source = self._snapshot
        if source is None:
            return None
        try:
            return source()
        except Exception:  # a scrape never breaks the server
            logger.exception("kvpersist: reading %s for /metrics failed", self.what)
            return None

    def bind(self, snapshot: Snapshot | None) -> bool:
        """Make the instruments read ``snapshot()`` (None: report nothing); False without
        OpenTelemetry."""
        self._snapshot = snapshot
        if self._registered:
            return True
        try:
            from opentelemetry import metrics
        except ImportError:
            return False
        meter = metrics.get_meter(self.meter)

        def observe(points: Points) -> Callable[[Any], list[Any]]:
            def callback(_options: Any) -> list[Any]:
                current = self.read()
                if current is None:
                    return []
                return [metrics.Observation(value, labels) for value, labels in points(current)]
            return callback

        for name, (doc, points) in self.counters.items():
            meter.create_observable_counter(name, callbacks=[observe(points)], description=doc)
        for name, (doc, points) in self.gauges.items():
            meter.create_observable_gauge(name, callbacks=[observe(points)], description=doc)
        self._registered = True
        return True
