"""Per-root file pools: a task's ``done`` runs exactly once, with every file's result in order,
and a root whose calls never return holds only its own threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpersist.l2.file_pools import FilePools


def test_done_runs_once_with_results_in_order_and_none_where_a_call_raised() -> None:
    pools = FilePools(2, 2)
    finished = threading.Event()
    seen: list[list[int | None]] = []

    def fail() -> int:
        raise OSError("EIO")

    def done(results: list[int | None]) -> None:
        seen.append(results)
        finished.set()

    try:
        calls = [(0, lambda: 1), (1, fail), (1, lambda: 3), (0, lambda: 4)]
        pools.run_all("test", calls, done)
        assert finished.wait(10)
        assert seen == [[1, None, 3, 4]]
        pools.run_all("empty", [], seen.append)
        assert seen[-1] == []
    finally:
        pools.shutdown()


def test_a_root_whose_calls_never_return_holds_only_its_own_threads() -> None:
    pools = FilePools(2, 1)
    release, stuck = threading.Event(), threading.Event()
    results: dict[str, list[int | None]] = {}
    finished = {name: threading.Event() for name in ("stuck", "other")}

    def hang() -> int:
        stuck.set()
        release.wait(30)
        return 0

    def done_as(name: str) -> Callable[[list[int | None]], None]:
        def done(r: list[int | None]) -> None:
            results[name] = r
            finished[name].set()
        return done

    try:
        pools.run_all("stuck", [(0, hang), (1, lambda: 1)], done_as("stuck"))
        assert stuck.wait(10)
        pools.run_all("other", [(1, lambda: 2), (1, lambda: 3)], done_as("other"))
        assert finished["other"].wait(10) and results["other"] == [2, 3]
        assert not finished["stuck"].is_set()  # its hung file is still out
        release.set()
        assert finished["stuck"].wait(10) and results["stuck"] == [0, 1]
    finally:
        release.set()
        pools.shutdown()


def test_a_task_given_to_shut_down_pools_still_finishes_once() -> None:
    pools = FilePools(1, 1)
    pools.shutdown()
    seen: list[list[int | None]] = []
    pools.run_all("late", [(0, lambda: 1), (0, lambda: 2)], seen.append)
    assert seen == [[None, None]]
