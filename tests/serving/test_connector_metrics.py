"""The connector's labelled counters survive vLLM's round trip: recorded on one side,
cloned, aggregated with another worker's, and observed into Prometheus counters."""

from __future__ import annotations

from kvpersist.serving.connector.metrics import (
    BYPASSES,
    COUNTERS,
    DROPPED_STORE_METRIC,
    DROPPED_STORES,
    FAILED_LOADS,
    KvPersistConnectorStats,
)


def test_counts_are_cloned_aggregated_and_reset() -> None:
    scheduler = KvPersistConnectorStats()
    scheduler.record_bypass("stalled")
    scheduler.record_dropped_stores("server_down", 3)
    worker = KvPersistConnectorStats()
    worker.record_failed_load("server_error")
    snapshot = scheduler.clone_and_reset()
    assert scheduler.is_empty() and not snapshot.is_empty()
    total = snapshot.aggregate(worker).aggregate(KvPersistConnectorStats(data={
        DROPPED_STORES: {"server_down": 2}}))
    assert total.data[BYPASSES] == {"stalled": 1}
    assert total.data[FAILED_LOADS] == {"server_error": 1}
    assert total.data[DROPPED_STORES] == {"server_down": 5}
    assert total.reduce()["kvpersist dropped stores (server_down)"] == 5


def test_dropped_stores_are_a_documented_metric() -> None:
    metric, reasons, documentation = COUNTERS[DROPPED_STORES]
    assert metric == DROPPED_STORE_METRIC == "vllm:kvpersist_dropped_stores_total"
    assert reasons == ("server_down", "weights_changed") and "not cached" in documentation
