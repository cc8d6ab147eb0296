"""The test-only store settling hook: when it waits, and when it must not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpersist.serving.connector.worker.store_fence import StoreFence
from kvpersist.testing import store_settling


class Future:
    def __init__(self, answered_after: int = 0) -> None:
        self.polls = 0
        self.answered_after = answered_after

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.answered_after


class Adapter:
    def __init__(self, **futures: Future) -> None:
        self.store_futures: dict[str, Any] = dict(futures)
        self.seen: list[bool] = []

    def get_finished(self, engine_finished: set[str]) -> tuple[set[str], set[str]]:
        self.seen.append(all(f.query() for f in self.store_futures.values()))
        return set(engine_finished), set()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def journal_of(tmp_path: Path, *events: str) -> Path:
    path = tmp_path / "faults.log"
    path.write_text("".join(f"{i}.0 {event} 42\n" for i, event in enumerate(events)))
    return path


def test_the_journal_tells_a_stopped_server_from_a_running_one(tmp_path: Path) -> None:
    assert not store_settling.server_stopped(tmp_path / "absent.log")
    assert store_settling.server_stopped(journal_of(tmp_path, "stop"))
    assert not store_settling.server_stopped(journal_of(tmp_path, "stop", "go"))
    assert store_settling.server_stopped(journal_of(tmp_path, "stop", "go", "stop"))


def test_a_running_server_s_stores_are_waited_for_until_answered(tmp_path: Path) -> None:
    clock = Clock()
    adapter = Adapter(a=Future(answered_after=5), b=Future())
    assert store_settling.wait_for_stores(adapter, journal_of(tmp_path), clock=clock,
                                          sleep=clock.sleep)
    assert clock.now > 0


def test_a_stopped_server_s_store_is_not_waited_for(tmp_path: Path) -> None:
    clock = Clock()
    adapter = Adapter(a=Future(answered_after=10**9))
    assert not store_settling.wait_for_stores(adapter, journal_of(tmp_path, "stop"),
                                              clock=clock, sleep=clock.sleep)
    assert clock.now == 0


def test_a_store_never_answered_is_given_up_after_the_bound(tmp_path: Path) -> None:
    clock = Clock()
    adapter = Adapter(a=Future(answered_after=10**9))
    assert not store_settling.wait_for_stores(adapter, journal_of(tmp_path), max_wait_s=2.0,
                                              clock=clock, sleep=clock.sleep)
    assert 2.0 <= clock.now < 2.0 + 2 * store_settling.POLL_S


def test_the_fence_s_get_finished_sees_the_stores_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreFence, "install", StoreFence.install)  # restored afterwards
    store_settling.install(journal_of(tmp_path))

    class Worker(Adapter):
        def handle_preemptions(self, need_flush: bool) -> None:
            pass

    worker = Worker(a=Future(answered_after=3))
    StoreFence(worker, server_url=None).install()
    assert worker.get_finished({"r"}) == ({"r"}, set())
    assert worker.seen == [True]  # LMCache's method found the store answered
    plain = Worker(a=Future(answered_after=3))  # another adapter, the hook's install undone
    monkeypatch.undo()
    StoreFence(plain, server_url=None).install()
    plain.get_finished(set())
    assert plain.seen == [False]
