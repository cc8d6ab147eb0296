"""The ordered announcement thread (kvpersist.l2.announcer): every batch delivered once, in
the order handed over across kinds, a failing delivery logged and skipped, close drains."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from kvpersist.l2.announcer import Announcer


def recording() -> tuple[list[tuple[str, list[Any], list[int] | None]], dict[str, Any]]:
    seen: list[tuple[str, list[Any], list[int] | None]] = []

    def deliver(kind: str) -> Any:
        return lambda keys, sizes: seen.append((kind, keys, sizes))

    return seen, {kind: deliver(kind) for kind in ("stored", "deleted", "accessed")}


def test_batches_arrive_in_the_order_handed_over_across_kinds_in_slices() -> None:
    seen, deliver = recording()
    gate = threading.Event()
    deliver["stored"] = (lambda real: lambda k, s: (gate.wait(10), real(k, s)))(deliver["stored"])
    a = Announcer(deliver, batch=4)
    a.announce("stored", list(range(10)), [1] * 10)
    a.announce("accessed", [3])
    a.announce("deleted", [3], [1])
    a.announce("stored", [], [])  # nothing to say: not queued
    assert a.pending == 3 and not a.wait_idle(0.05)
    gate.set()
    assert a.wait_idle(10) and a.pending == 0
    a.close(10)
    assert seen == [("stored", [0, 1, 2, 3], [1] * 4), ("stored", [4, 5, 6, 7], [1] * 4),
                    ("stored", [8, 9], [1] * 2), ("accessed", [3], None),
                    ("deleted", [3], [1])]


def test_a_failing_delivery_is_logged_and_the_next_batch_still_arrives(
        caplog: pytest.LogCaptureFixture) -> None:
    seen, deliver = recording()

    def broken(keys: list[Any], sizes: list[int] | None) -> None:
        raise RuntimeError("listener bug")

    deliver["deleted"] = broken
    a = Announcer(deliver)
    with caplog.at_level(logging.ERROR, logger="kvpersist.l2"):
        a.announce("deleted", ["k"], [1])
        a.announce("stored", ["k2"], [2])
        assert a.wait_idle(10)
    a.close(10)
    assert seen == [("stored", ["k2"], [2])]
    assert "announcing 1 deleted keys to LMCache failed" in caplog.text


def test_close_delivers_everything_handed_over_before_it() -> None:
    seen, deliver = recording()
    a = Announcer(deliver, batch=1)
    for i in range(50):
        a.announce("stored", [i], [i])
    a.close(10)
    assert [keys[0] for _, keys, _ in seen] == list(range(50))


def test_bad_input_is_refused_with_a_clear_error() -> None:
    _, deliver = recording()
    a = Announcer(deliver)
    try:
        with pytest.raises(ValueError, match="3 keys but 2 sizes"):
            a.announce("stored", [1, 2, 3], [1, 1])
        with pytest.raises(ValueError, match="unknown kind of announcement 'evicted'"):
            a.announce("evicted", [1])
    finally:
        a.close(10)
    with pytest.raises(ValueError, match="batch must be positive"):
        Announcer(deliver, batch=0)
