"""The lookup deadline: a stalled server is bypassed, a progressing load is waited for."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from kvpersist.serving.connector.scheduler.lookup_deadline import (
    LookupDeadline,
    ServerProgressProbe,
    progress_token,
)
from kvpersist.testing.helpers import wait_until
from kvpersist.testing.http_stub import http_stub


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_server_is_bypassed_after_the_deadline() -> None:
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=600, clock=clock)
    d.begin("r")
    clock.now += 4.9
    assert d.verdict("r", healthy=True) is None
    clock.now += 0.2
    assert "no progress for 5.1s" in str(d.verdict("r", healthy=True))


def test_a_progressing_load_is_not_bypassed() -> None:
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=600, clock=clock)
    d.begin("r")
    for _ in range(60):  # 60 s of a restore that reports progress every second
        clock.now += 1
        d.progressed()
        assert d.verdict("r", healthy=True) is None
    clock.now += 5.5  # then the server stops moving
    assert "stalled" in str(d.verdict("r", healthy=True))


def test_the_ceiling_holds_whatever_the_progress() -> None:
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=30, clock=clock)
    d.begin("r")
    while clock.now < 1029:
        clock.now += 1
        d.progressed()
        assert d.verdict("r", healthy=True) is None
    clock.now += 2
    d.progressed()
    assert "limit 30s" in str(d.verdict("r", healthy=True))


def test_a_server_whose_socket_refuses_is_bypassed_at_once() -> None:
    d = LookupDeadline(stall_s=5, max_s=600, clock=FakeClock())
    d.begin("r")
    assert "nobody listens" in str(d.verdict("r", healthy=False, gone=True))


def test_missed_beats_alone_are_not_a_death() -> None:
    """A live server starved of CPU misses 2 s beats (seen at TP=2 on 2 cores): the heartbeat
    must say unhealthy for dead_after_s without a break, and without progress, first."""
    clock = FakeClock()
    d = LookupDeadline(stall_s=60, max_s=600, clock=clock, dead_after_s=6)
    d.begin("r")
    clock.now += 1
    assert d.verdict("r", healthy=False) is None
    clock.now += 4.9  # unhealthy 4.9 s
    assert d.verdict("r", healthy=False) is None
    clock.now += 0.1
    assert d.verdict("r", healthy=True) is None  # one beat answered: the count starts again
    clock.now += 5.9
    assert d.verdict("r", healthy=False) is None
    clock.now += 6.1
    assert "unhealthy for 6.1s" in str(d.verdict("r", healthy=False))


def test_a_heartbeat_flap_during_a_progressing_load_is_not_a_bypass() -> None:
    """A server busy loading gigabytes missed its 2 s heartbeat while its counters kept moving
    (seen with a 2 GiB restore on 2 cores): alive, so the restore goes on."""
    clock = FakeClock()
    d = LookupDeadline(stall_s=60, max_s=600, clock=clock, dead_after_s=5)
    d.begin("r")
    assert d.verdict("r", healthy=False) is None
    for _ in range(20):  # unhealthy for 20 s while the server's counters move
        clock.now += 1
        d.progressed()
        assert d.verdict("r", healthy=False) is None
    clock.now += 5.5  # no progress for 5.5 s and still unhealthy: dead
    assert "unhealthy" in str(d.verdict("r", healthy=False))


def test_progress_before_a_lookup_began_does_not_count_for_it() -> None:
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=600, clock=clock)
    d.progressed()
    clock.now += 100
    d.begin("late")
    clock.now += 4
    assert d.verdict("late", healthy=True) is None
    clock.now += 2
    assert d.verdict("late", healthy=True) is not None
    d.end("late")
    assert d.pending == 0 and d.verdict("late", healthy=True) is None


def test_a_pause_of_the_watching_process_is_not_the_servers_stall() -> None:
    """vLLM's own process held 5 s (seen on 2 cores: page faults after a page-cache drop) while
    the server kept reading: with a probe watching, quiet time runs only up to its last look."""
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=600, clock=clock)
    d.looked()
    d.begin("r")
    clock.now += 1
    d.progressed()
    d.looked()
    clock.now += 6  # the probe could not look: nothing is known about these 6 s
    assert d.verdict("r", healthy=True) is None
    assert d.verdict("r", healthy=False) is None  # nor is a heartbeat that missed them
    d.progressed()  # the first look after the pause sees the counters moved
    d.looked()
    for _ in range(5):  # then looks that see nothing move
        clock.now += 1.1
        d.looked()
    assert "no progress for 5.5s" in str(d.verdict("r", healthy=True))


def test_a_probe_that_stops_looking_does_not_hold_a_lookup_forever() -> None:
    clock = FakeClock()
    d = LookupDeadline(stall_s=5, max_s=600, clock=clock, blind_s=30)
    d.looked()
    d.begin("r")
    clock.now += 29
    assert d.verdict("r", healthy=True) is None
    clock.now += 2  # 31 s without a look: judged up to now again
    assert "stalled" in str(d.verdict("r", healthy=True))


def test_progress_token_reads_the_load_counters() -> None:
    status = {"storage_manager": {
        "l2_adapters": [{"read_bytes": 10, "loaded_bytes": 8}, {"type": "nixl"}],
        "l1_managers": {"_default": {"memory_used_bytes": 100, "staging_bytes": 5}},
        "prefetch_controller": {"completed_results_count": 2, "load_phase_count": 1}}}
    assert progress_token(status) == (10.0, 8.0, 105.0, 2.0, 1.0)
    assert progress_token({}) == (0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.fixture
def status_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real HTTP server whose /status shows counters the test moves."""
    state: dict[str, Any] = {"read_bytes": 0, "answer": True}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not state["answer"]:
                time.sleep(2)  # hangs past the probe's timeout
            body = json.dumps({"storage_manager": {"l2_adapters": [
                {"read_bytes": state["read_bytes"]}]}}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the probe gave up on a hanging answer, as the test means it to

        def log_message(self, *args: Any) -> None:
            return None

    with http_stub(Handler) as url:
        yield f"{url}/status", state


class _LookRecordingDeadline(LookupDeadline):
    """A real deadline that also notes when each look began (before the deadline notes it, so
    a noted time is never later than the one the deadline judges from)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looks: list[float] = []

    def looked(self) -> None:
        self.looks.append(time.monotonic())
        super().looked()


@pytest.mark.serial  # the probe's 0.5 s timeout needs a core
def test_the_probe_sees_progress_and_its_absence(status_server: tuple[str, dict[str, Any]]
                                                 ) -> None:
    url, state = status_server
    blind_s = 3.0
    deadline = _LookRecordingDeadline(stall_s=0.8, max_s=60, blind_s=blind_s)
    probe = ServerProgressProbe(url, deadline, interval_s=0.1, timeout_s=0.5)
    try:
        deadline.begin("r")
        until = time.monotonic() + 2.0
        while time.monotonic() < until:  # the server reads 1 MB every 0.1 s
            state["read_bytes"] += 1 << 20
            time.sleep(0.1)  # pacing of the simulated reads
            assert deadline.verdict("r", healthy=True) is None
        # counters frozen: judged stalled once the probe has looked past stall_s (0.8 s)
        wait_until(lambda: "stalled" in str(deadline.verdict("r", healthy=True)), timeout=10,
                   interval=0.05, message="frozen counters were never judged stalled")
        deadline.end("r")
        deadline.begin("s")
        state["answer"] = False  # a server that answers nothing: its progress is unknown
        state["read_bytes"] += 1
        # every probe times out (0.5 s): an unanswered poll is no look, so nothing is judged
        # while the probe is blind (a CPU-starved server reading its disk answers late) ...
        time.sleep(1.5)
        verdict = deadline.verdict("s", healthy=True)
        asked_at = time.monotonic()
        assert deadline.looks, "the probe never saw an answer"
        assert verdict is None or asked_at - deadline.looks[-1] > blind_s, (
            f"judged {verdict} only {asked_at - deadline.looks[-1]:.2f}s after the last look")
        # ... until blind_s (3 s) passed since the last answered look: then judged up to now
        wait_until(lambda: "stalled" in str(deadline.verdict("s", healthy=True)), timeout=10,
                   interval=0.05, message="a hung server was never judged stalled")
        judged_at = time.monotonic()
        assert judged_at - deadline.looks[-1] > blind_s, (
            f"judged stalled {judged_at - deadline.looks[-1]:.2f}s after the last answered look, "
            f"before blind_s ({blind_s}s)")
    finally:
        probe.close()
