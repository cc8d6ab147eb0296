"""The connector's own numbers in vLLM's ``/metrics``: lookups that bypassed the cache and loads
that failed, by reason.

vLLM collects connector statistics through ``KVConnectorStats`` objects (the scheduler's and the
workers', aggregated, sent to the API server) and exposes them through the connector class's
``KVConnectorPromMetrics``.  These classes extend LMCache's (its lookup-latency histogram stays)
with ``vllm:kvpersist_lookup_bypasses_total{reason=...}``,
``vllm:kvpersist_failed_loads_total{reason=...}`` and ``vllm:kvpersist_dropped_stores_total``.

Invariants
----------
* A bypass is counted once, by the scheduler connector that decided it, under one of
  :data:`BYPASS_REASONS`; a failed load once per worker that reported it, under one of
  :data:`FAILED_LOAD_REASONS`; a store not sent once, by the scheduler that dropped it;
  aggregation adds counts and never drops LMCache's own data.
* Every class here is serializable the way vLLM needs: the payload is the ``data`` dict.
"""

from __future__ import annotations

from typing import Any

from lmcache.integration.vllm.lmcache_mp_metrics import (
    LMCacheMPConnectorStats,
    LMCacheMPPromMetrics,
)

from .worker.load_fence import FAILED_LOAD_REASONS

BYPASSES = "kvpersist_bypasses"
#: server_down: the server's socket refuses, or the heartbeat said unhealthy for several
#: seconds without progress; stalled: no progress for the lookup deadline; too_long: the
#: lookup ceiling (``KVP_LOOKUP_MAX_S``) was reached.
BYPASS_REASONS = ("server_down", "stalled", "too_long")
BYPASS_METRIC = "vllm:kvpersist_lookup_bypasses_total"
FAILED_LOADS = "kvpersist_failed_loads"
FAILED_LOAD_METRIC = "vllm:kvpersist_failed_loads_total"
DROPPED_STORES = "kvpersist_dropped_stores"
DROPPED_STORE_METRIC = "vllm:kvpersist_dropped_stores_total"
#: server_down: the scheduler's heartbeat said the server is down when the store was due.
#: weights_changed: the engine's weights may have changed at run time (a collective RPC).
DROPPED_STORE_REASONS = ("server_down", "weights_changed")
UNCACHED = "kvpersist_uncached_requests"
UNCACHED_METRIC = "vllm:kvpersist_uncached_requests_total"
#: prompt_embeds: the request carries prompt embeddings (no content key); lora_not_local,
#: lora_unreadable, lora_changed: its LoRA adapter cannot be keyed by content
#: (:mod:`kvpersist.serving.connector.request_keys`); mm_no_content: a multimodal item reached
#: the scheduler without inputs kvpersist can digest (vLLM's shm processor cache).
#: weights_changed: the engine's weights may have changed at run time; lora_id_reused: one
#: adapter id named two adapters; lora_reloaded: the adapter was reloaded in place;
#: lora_digest_pending: a large adapter is still being digested off the scheduler's thread;
#: mm_bidirectional: the model attends bidirectionally over multimodal items; key_error:
#: deriving the request's key raised (logged with its traceback).
UNCACHED_REASONS = ("prompt_embeds", "lora_not_local", "lora_unreadable", "lora_changed",
                    "mm_no_content", "weights_changed", "lora_id_reused", "lora_reloaded",
                    "lora_digest_pending", "mm_bidirectional", "key_error")
#: What each labelled counter of these stats is: data key -> (metric, reasons, help text).
COUNTERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    BYPASSES: (BYPASS_METRIC, BYPASS_REASONS,
               "Requests whose KV-cache lookup kvpersist abandoned (recomputed), by reason: "
               "server_down, stalled, too_long."),
    FAILED_LOADS: (FAILED_LOAD_METRIC, FAILED_LOAD_REASONS,
                   "KV loads a worker reported failed to vLLM (the prompt is recomputed), "
                   "counted per worker, by reason: server_error (the server answered that it "
                   "failed), server_gone (its server exited with the load in flight), "
                   "unhealthy_at_submit (never sent: the heartbeat said unhealthy)."),
    DROPPED_STORES: (DROPPED_STORE_METRIC, DROPPED_STORE_REASONS,
                     "Stores the scheduler did not send (those chunks are not cached), by "
                     "reason: server_down (the heartbeat said the server is down), "
                     "weights_changed (the engine's weights may have changed at run time)."),
    UNCACHED: (UNCACHED_METRIC, UNCACHED_REASONS,
               "Requests kvpersist neither looked up nor stored because their KV cannot be "
               "keyed exactly, by reason: prompt_embeds, lora_not_local, lora_unreadable, "
               "lora_changed, mm_no_content, weights_changed, lora_id_reused, "
               "lora_reloaded, lora_digest_pending, mm_bidirectional, key_error."),
}


class KvPersistConnectorStats(LMCacheMPConnectorStats):  # type: ignore[misc]
    """LMCache's lookup latencies plus kvpersist's labelled counters (:data:`COUNTERS`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in COUNTERS:
            self.data.setdefault(key, {})

    def _count(self, key: str, reason: str, n: int = 1) -> None:
        counts = self.data[key]
        counts[reason] = counts.get(reason, 0) + n

    def record_bypass(self, reason: str) -> None:
        self._count(BYPASSES, reason)

    def record_uncached(self, reason: str) -> None:
        self._count(UNCACHED, reason)

    def record_failed_load(self, reason: str, n: int = 1) -> None:
        self._count(FAILED_LOADS, reason, n)

    def record_dropped_stores(self, reason: str, n: int) -> None:
        self._count(DROPPED_STORES, reason, n)

    def clone_and_reset(self) -> KvPersistConnectorStats:
        snapshot = KvPersistConnectorStats(data={
            key: (dict(value) if isinstance(value, dict) else list(value))
            for key, value in self.data.items()})
        self.reset()
        return snapshot

    def reset(self) -> None:
        super().reset()
        for key in COUNTERS:
            self.data[key] = {}

    def aggregate(self, other: Any) -> KvPersistConnectorStats:
        super().aggregate(other)
        theirs = getattr(other, "data", {})
        for key in COUNTERS:
            for reason, count in theirs.get(key, {}).items():
                self._count(key, reason, count)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(super().reduce())
        for reason, count in self.data[BYPASSES].items():
            out[f"kvpersist bypasses ({reason})"] = count
        for reason, count in self.data[FAILED_LOADS].items():
            out[f"kvpersist failed loads ({reason})"] = count
        for reason, count in self.data[DROPPED_STORES].items():
            out[f"kvpersist dropped stores ({reason})"] = count
        for reason, count in self.data[UNCACHED].items():
            out[f"kvpersist uncached requests ({reason})"] = count
        return out

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not any(self.data[key] for key in COUNTERS)


class KvPersistPromMetrics(LMCacheMPPromMetrics):  # type: ignore[misc]
    """LMCache's metrics plus one labelled counter per entry of :data:`COUNTERS`."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._kvp_series: dict[str, dict[int, dict[str, Any]]] = {}
        for key, (metric, reasons, documentation) in COUNTERS.items():
            counter = self._counter_cls(name=metric.removesuffix("_total"),
                                        documentation=documentation,
                                        labelnames=[*labelnames, "reason"])
            self._kvp_series[key] = {
                engine: {reason: counter.labels(*values, reason) for reason in reasons}
                for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, series in self._kvp_series.items():
            for reason, count in transfer_stats_data.get(key, {}).items():
                counter = series[engine_idx].get(reason)
                if counter is not None and count:
                    counter.inc(count)
