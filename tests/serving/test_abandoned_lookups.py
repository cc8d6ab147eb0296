"""Abandoned lookups are settled by one thread, however many wait (no thread per lookup)."""

from __future__ import annotations

import threading

from kvpersist.serving.lmcache_compat.l1_window.abandoned import AbandonedLookups
from kvpersist.testing.helpers import wait_until


def settler_threads() -> int:
    return sum(t.name == "kvp-release-abandoned" for t in threading.enumerate())


def test_a_hundred_abandoned_lookups_wait_on_one_thread_and_each_is_settled_once() -> None:
    abandoned = AbandonedLookups(poll_s=0.01)
    finished = [threading.Event() for _ in range(100)]
    settled: list[int] = []
    for i, event in enumerate(finished):
        abandoned.add(f"req-{i}", event.is_set, lambda i=i: settled.append(i))
    assert abandoned.waiting == 100
    assert settler_threads() == 1
    for i in range(0, 100, 2):
        finished[i].set()
    wait_until(lambda: len(settled) == 50, timeout=10, interval=0.02)
    assert sorted(settled) == list(range(0, 100, 2))
    assert abandoned.waiting == 50
    for event in finished:
        event.set()
    wait_until(lambda: abandoned.waiting == 0, timeout=10, interval=0.02)
    assert sorted(settled) == list(range(100))  # each exactly once
    wait_until(lambda: settler_threads() == 0, timeout=10, interval=0.02)  # the settler leaves when idle


def test_the_settler_starts_again_after_it_left() -> None:
    abandoned = AbandonedLookups(poll_s=0.01)
    settled: list[str] = []
    abandoned.add("a", lambda: True, lambda: settled.append("a"))
    wait_until(lambda: settled == ["a"] and settler_threads() == 0, timeout=10, interval=0.02)
    abandoned.add("b", lambda: True, lambda: settled.append("b"))
    wait_until(lambda: settled == ["a", "b"], timeout=10, interval=0.02)


def test_a_load_that_never_finishes_is_dropped_after_the_limit_and_a_failing_release_too(
        ) -> None:
    now = [0.0]
    abandoned = AbandonedLookups(poll_s=0.01, max_wait_s=60.0, clock=lambda: now[0])
    settled: list[str] = []

    def failing() -> None:
        raise RuntimeError("LMCache refused")

    abandoned.add("stuck", lambda: False, lambda: settled.append("stuck"))
    abandoned.add("failing", lambda: True, failing)
    abandoned.add("fine", lambda: True, lambda: settled.append("fine"))
    wait_until(lambda: abandoned.waiting == 1, timeout=10, interval=0.02)  # failing and fine left
    assert settled == ["fine"]
    now[0] = 61.0
    wait_until(lambda: abandoned.waiting == 0, timeout=10, interval=0.02)
    assert settled == ["fine"]  # the stuck one was never settled, only dropped
