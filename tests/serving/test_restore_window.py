"""The window rules of a restore larger than free L1 (pure; the e2e proof is
``tests/e2e/test_l1_window_e2e.py``)."""

from __future__ import annotations

import pytest

from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.serving.restore_window import (
    Bounded,
    RestoreStats,
    Segment,
    ServedPrefixes,
    WindowPlan,
    pick_evictions,
    plan_lookup_window,
    promised_hit,
    promised_prefix,
    retrieve_segments,
    served_blocks,
    window_columns,
)

MB = 2**20


def test_the_promised_prefix_stops_at_the_first_hole() -> None:
    assert promised_prefix([True, True, False, True]) == 2
    assert promised_prefix([False, True]) == 0
    assert promised_prefix([True] * 5) == 5
    assert promised_prefix([]) == 0


def test_a_lookup_loads_one_window_and_defers_the_rest() -> None:
    present = [True] * 10 + [False, True]
    plan = plan_lookup_window(present, [16 * MB] * 12, 40 * MB)
    assert plan == WindowPlan(loaded=2, prefix=10)
    assert plan.deferred == 8


def test_chunks_already_in_l1_cost_the_window_nothing() -> None:
    cost = [0, 0, 0, 16 * MB, 16 * MB, 16 * MB]
    assert plan_lookup_window([True] * 6, cost, 32 * MB) == WindowPlan(5, 6)


def test_a_window_smaller_than_one_chunk_still_loads_one() -> None:
    assert plan_lookup_window([True] * 4, [16 * MB] * 4, MB) == WindowPlan(1, 4)


def test_a_prefix_inside_the_window_or_no_streaming_defers_nothing() -> None:
    assert plan_lookup_window([True] * 3, [MB] * 3, 16 * MB) == WindowPlan(3, 3)
    assert plan_lookup_window([True] * 9, [16 * MB] * 9, 0) == WindowPlan(9, 9)
    with pytest.raises(ValueError):
        plan_lookup_window([True], [1, 2], MB)


def test_a_deferred_promise_is_kept_only_when_the_window_landed() -> None:
    plan = WindowPlan(loaded=2, prefix=10)
    assert promised_hit(plan, 2) == 10
    assert promised_hit(plan, 3) == 10  # L1 residents past the window extend what landed
    assert promised_hit(plan, 1) == 1  # a hole in the window: never promise past it
    assert promised_hit(None, 4) == 4
    assert promised_hit(WindowPlan(5, 5), 3) == 3


def test_segments_tile_the_range_locked_first_then_windows() -> None:
    assert retrieve_segments(0, 2, 9, 3) == [Segment(0, 2, True), Segment(2, 5, False),
                                             Segment(5, 8, False), Segment(8, 9, False)]
    assert retrieve_segments(3, 2, 5, 1) == [Segment(3, 4, False), Segment(4, 5, False)]
    assert retrieve_segments(0, 6, 4, 2) == [Segment(0, 4, True)]
    for start, locked, end, per in [(0, 0, 7, 2), (1, 3, 11, 4), (5, 5, 5, 1)]:
        segments = retrieve_segments(start, locked, end, per)
        cols = [c for s in segments for c in range(s.start, s.end)]
        assert cols == list(range(start, end))
        assert all(len(s) <= per for s in segments if not s.locked)
    with pytest.raises(ValueError):
        retrieve_segments(0, 0, 3, 0)
    with pytest.raises(ValueError):
        retrieve_segments(4, 0, 3, 1)


def test_window_columns() -> None:
    assert window_columns(40 * MB, 16 * MB) == 2
    assert window_columns(MB, 16 * MB) == 1
    with pytest.raises(ValueError):
        window_columns(MB, 0)


def test_eviction_takes_clean_unheld_objects_oldest_first_and_no_more_than_needed() -> None:
    oldest_first = [("held", 10), ("dirty", 10), ("a", 10), ("b", 10), ("c", 10)]
    evictable = {"a", "b", "c"}.__contains__
    assert pick_evictions(oldest_first, 15, evictable) == ["a", "b"]
    assert pick_evictions(oldest_first, 10, evictable) == ["a"]
    assert pick_evictions(oldest_first, 100, evictable) == ["a", "b", "c"]
    assert pick_evictions(oldest_first, 0, evictable) == []


def test_stats_count_cuts_by_reason() -> None:
    stats = RestoreStats()
    stats.cut("l1_full", 512)
    stats.cut("l1_full", 256)
    stats.add(streamed_restores=1, evicted_objects=3)
    snap = stats.snapshot()
    assert snap["cut_short"] == {"l1_full": 2}
    assert snap["cut_short_tokens"] == {"l1_full": 768}
    assert (snap["streamed_restores"], snap["evicted_objects"]) == (1, 3)


def test_the_window_setting() -> None:
    assert load_settings({"KVP_L1_SIZE_GB": "64"}).restore_window_gb == 2.0
    assert load_settings({"KVP_L1_SIZE_GB": "4"}).restore_window_gb == 0.5
    assert load_settings({"KVP_RESTORE_WINDOW_GB": "0"}).restore_window_gb == 0.0
    assert load_settings({"KVP_RESTORE_WINDOW_GB": "1.5"}).restore_window_gb == 1.5
    with pytest.raises(SettingsError, match="half of KVP_L1_SIZE_GB"):
        load_settings({"KVP_L1_SIZE_GB": "2", "KVP_RESTORE_WINDOW_GB": "1.5"})
    with pytest.raises(SettingsError):
        load_settings({"KVP_RESTORE_WINDOW_GB": "lots"})


def test_a_failed_retrieve_records_what_it_served_and_the_next_retrieve_clears_it() -> None:
    served = ServedPrefixes(capacity=2)
    assert served.served("r1", 7) is None
    served.record("r1", 7, 5)
    assert served.served("r1", 7) == 5 and served.served("r1", 8) is None
    served.clear("r1", 7)  # the request's next retrieve by that worker
    assert served.served("r1", 7) is None
    for rid in ("a", "b", "c"):
        served.record(rid, 1, 1)
    assert served.served("a", 1) is None and served.served("c", 1) == 1  # oldest forgotten
    with pytest.raises(ValueError):
        served.record("r", 1, -1)


def test_the_blocks_of_served_chunks_are_not_load_errors() -> None:
    blocks = list(range(100, 112))  # 6 chunks of 2 blocks
    assert served_blocks(blocks, 0, 2) == []
    assert served_blocks(blocks, 4, 2) == blocks[:8]  # 108..111 are not served
    assert served_blocks(blocks, 6, 2) == blocks
    with pytest.raises(ValueError):
        served_blocks(blocks, 1, 0)


def test_records_never_consumed_are_bounded_oldest_first() -> None:
    records: Bounded[int, str] = Bounded(capacity=3)
    for pid in range(5):
        records[pid] = f"plan {pid}"
    assert list(records) == [2, 3, 4]
    records[2] = "set again"  # setting one makes it the newest
    records[5] = "plan 5"
    assert list(records) == [4, 2, 5] and records.pop(9, None) is None
