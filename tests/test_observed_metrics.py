"""The shared scrape-time metric helpers (:mod:`kvpersist.observed_metrics`)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpersist.observed_metrics import ObservedMetrics, by_label, field, fields


def test_points_read_from_a_snapshot() -> None:
    snapshot = {"stores": 3, "cut_short": {"l1_full": 2, "load_failed": 1}}
    assert list(field("stores")(snapshot)) == [(3, {})]
    assert list(field("absent")(snapshot)) == [(0, {})]
    assert list(fields({"stores": {"k": "v"}})(snapshot)) == [(3, {"k": "v"})]
    assert sorted(by_label("cut_short", "reason")(snapshot), key=lambda p: p[0]) == [
        (1, {"reason": "load_failed"}), (2, {"reason": "l1_full"})]
    assert list(by_label("nothing", "reason")(snapshot)) == []


def test_a_failing_or_unbound_snapshot_reads_as_nothing(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    observed = ObservedMetrics("kvpersist.test", "a test snapshot", counters={})
    assert observed.read() is None

    def broken() -> dict[str, Any]:
        raise OSError("gone")

    observed._snapshot = broken
    assert observed.read() is None
    assert "reading a test snapshot for /metrics failed" in caplog.text
