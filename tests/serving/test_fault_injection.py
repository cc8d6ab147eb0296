"""The test-only faults refuse malformed values and change nothing unset; the hold really
holds an L2 load while its file exists (on kvpersist's own adapter class)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.testing import fault_injection


def test_unset_faults_change_nothing_and_malformed_ones_are_refused() -> None:
    assert fault_injection.install({}) is None
    assert fault_injection.hold_path({}) is None
    with pytest.raises(ValueError, match="absolute path"):
        fault_injection.hold_path({fault_injection.HOLD_LOADS_WHILE: "relative/file"})
    with pytest.raises(ValueError, match="number of seconds"):
        fault_injection.stop_seconds({fault_injection.STOP_IN_RETRIEVE: "soon"})


def test_the_two_store_stops_cannot_be_combined() -> None:
    with pytest.raises(ValueError, match="set one of them"):
        fault_injection.install({fault_injection.STOP_IN_STORE: "5",
                                 fault_injection.STOP_IN_SECOND_STORE: "5"})


def test_the_second_store_stop_waits_for_a_request_seen_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stops: list[float] = []
    monkeypatch.setattr(fault_injection, "stop_process", stops.append)
    stopper = fault_injection._RepeatedRequestStopper(7.0)
    for request_id in ("a", "b", "c"):  # each request's first store goes through
        stopper(request_id)
    assert stops == []
    stopper("b")  # b's second store: the stop
    assert stops == [7.0]
    for request_id in ("a", "b", "c", "d"):  # once per process
        stopper(request_id)
    assert stops == [7.0]


def test_the_hold_names_the_adapters_load() -> None:
    import importlib

    module_name, class_name, method = fault_injection.HELD_LOAD
    assert callable(getattr(getattr(importlib.import_module(module_name), class_name), method))


def test_a_held_load_waits_for_its_file_to_go(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.write_text("")
    ran: list[float] = []

    def load(_adapter: Any, tid: int) -> int:
        ran.append(time.monotonic())
        return tid

    held = fault_injection._holding(load, hold)
    thread = threading.Thread(target=held, args=(None, 7))
    thread.start()
    time.sleep(0.3)  # on purpose, not a condition: a window in which the load must not run
    assert ran == [], "the load ran while its hold file existed"
    released = time.monotonic()
    hold.unlink()
    thread.join(5)
    assert len(ran) == 1 and ran[0] >= released


def test_only_the_testing_entry_point_reads_fault_variables(tmp_path: Path) -> None:
    """A malformed fault variable stops a server started through the testing entry point (the
    fault machinery is there) and is ignored by the production entry point (it is not)."""
    import os

    from kvpersist.config.server import load_settings
    from kvpersist.serving.server.lifecycle import ServerError, start_server, stop_server
    from kvpersist.testing.fault_server import FAULT_ENTRY
    from kvpersist.testing.helpers import server_env

    settings = load_settings(server_env(tmp_path / "cache"))
    env = {**os.environ, fault_injection.STOP_IN_RETRIEVE: "soon"}
    with pytest.raises(ServerError, match="is not a number of seconds"):
        start_server(settings, env=env, entry=FAULT_ENTRY)
    start_server(settings, env=env)
    stop_server(settings)


def test_the_journal_reads_as_its_events_in_order(tmp_path: Path) -> None:
    journal = tmp_path / "faults.log"
    assert fault_injection.journal_events(journal) == []  # nothing journaled yet
    journal.write_text("1.0 stop 42\n2.0 go 42\n3.0")  # the last line still being appended
    assert fault_injection.journal_events(journal) == ["stop", "go"]
