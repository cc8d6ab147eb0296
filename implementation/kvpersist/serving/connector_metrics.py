"""The connector's own numbers in vLLM's ``/metrics``: lookups that bypassed the cache, by reason.

vLLM collects connector statistics through ``KVConnectorStats`` objects (the scheduler's and the
workers', aggregated, sent to the API server) and exposes them through the connector class's
``KVConnectorPromMetrics``.  These classes extend LMCache's (its lookup-latency histogram stays)
with ``vllm:kvpersist_lookup_bypasses_total{reason=...}``.

Invariants
----------
* A bypass is counted once, by the scheduler connector that decided it, under one of
  :data:`BYPASS_REASONS`; aggregation adds counts and never drops LMCache's own data.
* Every class here is serializable the way vLLM needs: the payload is the ``data`` dict.
"""

from __future__ import annotations

from typing import Any

from lmcache.integration.vllm.lmcache_mp_metrics import (
    LMCacheMPConnectorStats,
    LMCacheMPPromMetrics,
)

BYPASSES = "kvpersist_bypasses"
#: server_down: the heartbeat says the server is down; stalled: no progress for the lookup
#: deadline; too_long: the lookup ceiling (``KVP_LOOKUP_MAX_S``) was reached.
BYPASS_REASONS = ("server_down", "stalled", "too_long")
BYPASS_METRIC = "vllm:kvpersist_lookup_bypasses_total"


class KvPersistConnectorStats(LMCacheMPConnectorStats):  # type: ignore[misc]
    """LMCache's lookup latencies plus kvpersist's bypass counts (reason -> count)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data.setdefault(BYPASSES, {})

    def record_bypass(self, reason: str) -> None:
        counts = self.data[BYPASSES]
        counts[reason] = counts.get(reason, 0) + 1

    def clone_and_reset(self) -> KvPersistConnectorStats:
        snapshot = KvPersistConnectorStats(data={
            key: (dict(value) if isinstance(value, dict) else list(value))
            for key, value in self.data.items()})
        self.reset()
        return snapshot

    def reset(self) -> None:
        super().reset()
        self.data[BYPASSES] = {}

    def aggregate(self, other: Any) -> KvPersistConnectorStats:
        super().aggregate(other)
        for reason, count in getattr(other, "data", {}).get(BYPASSES, {}).items():
            self.data[BYPASSES][reason] = self.data[BYPASSES].get(reason, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(super().reduce())
        for reason, count in self.data[BYPASSES].items():
            out[f"kvpersist bypasses ({reason})"] = count
        return out

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not self.data[BYPASSES]


class KvPersistPromMetrics(LMCacheMPPromMetrics):  # type: ignore[misc]
    """LMCache's metrics plus ``vllm:kvpersist_lookup_bypasses_total{reason}``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name=BYPASS_METRIC.removesuffix("_total"),
            documentation="Requests whose KV-cache lookup kvpersist abandoned (recomputed), "
                          "by reason: server_down, stalled, too_long.",
            labelnames=[*labelnames, "reason"])
        self._bypasses = {
            engine: {reason: counter.labels(*values, reason) for reason in BYPASS_REASONS}
            for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for reason, count in transfer_stats_data.get(BYPASSES, {}).items():
            series = self._bypasses[engine_idx].get(reason)
            if series is not None and count:
                series.inc(count)
