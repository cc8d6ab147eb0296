"""The worker's wait for a restore's KV: a long reply from a live server is waited for, a dead
server is given up on, and LMCache's replaced method is still the one this was written for."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import threading
import time

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.serving.connector.worker.transfer_wait import ServerWait
from kvpersist.serving.http import refuses_connections
from kvpersist.serving.lmcache_compat.pickle_transport import REPLACED, install, uninstall
from kvpersist.serving.pidfile import check_pid_file
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.helpers import wait_until
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.processes import kill_server


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowReply:
    """A future whose result is ready at ``ready_at`` on ``clock`` (None: never); each wait
    advances the clock by its timeout, as a blocking wait would."""

    def __init__(self, clock: Clock, ready_at: float | None) -> None:
        self.clock, self.ready_at = clock, ready_at

    def result(self, timeout: float) -> str:
        if self.ready_at is not None and self.clock.now + timeout >= self.ready_at:
            self.clock.now = max(self.clock.now, self.ready_at)
            return "reply"
        self.clock.now += timeout
        raise TimeoutError


def policy(clock: Clock, alive: list[bool], gone: list[bool] | None = None) -> ServerWait:
    return ServerWait(lambda: alive[0], gone=lambda: bool(gone and gone[0]), base_s=15.0,
                      max_s=600.0, dead_after_s=6.0, poll_s=0.25, clock=clock)


def test_a_reply_within_the_base_timeout_is_taken_as_lmcache_would() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    assert wait.reply(SlowReply(clock, 3.0)) == "reply" and wait.extended == 0


def test_a_long_reply_from_a_live_server_is_waited_for() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    assert wait.reply(SlowReply(clock, 95.0)) == "reply"  # 2 GiB pickled on CPU: minutes
    assert wait.extended == 1 and clock.now == pytest.approx(95.0)


def test_a_heartbeat_flap_does_not_end_the_wait_but_a_dead_server_does() -> None:
    clock, alive = Clock(), [True]
    wait = policy(clock, alive)
    reply = SlowReply(clock, 40.0)

    def flapping() -> bool:  # unhealthy for 4 s around t=20, then healthy again
        return not 20.0 <= clock.now < 24.0

    wait.alive = flapping
    assert wait.reply(reply) == "reply"
    clock2 = Clock()
    dead = policy(clock2, [False])
    with pytest.raises(TimeoutError):
        dead.reply(SlowReply(clock2, None))
    # given up dead_after_s (6 s) after the heartbeat turned, not at the 15 s base nor the ceiling
    assert 6.0 <= clock2.now <= 6.5 and dead.abandoned == 1


def test_the_ceiling_holds_for_a_live_server_that_never_answers() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    with pytest.raises(TimeoutError):
        wait.reply(SlowReply(clock, None))
    assert clock.now == pytest.approx(600.0, abs=0.5)


def test_a_receipt_is_waited_for_up_to_the_base_timeout_while_healthy() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    assert wait.receipt(SlowReply(clock, 12.0)) == "reply"
    with pytest.raises(TimeoutError):
        wait.receipt(SlowReply(clock, None))
    assert clock.now == pytest.approx(12.0 + 15.0, abs=0.5)  # LMCache's own bound, not more
    assert wait.receipts_abandoned == 0  # a timeout at the base is LMCache's, not ours


def test_a_receipt_is_given_up_at_once_when_the_heartbeat_says_unhealthy() -> None:
    clock, alive = Clock(), [True]
    wait = policy(clock, alive)
    reply = SlowReply(clock, None)
    alive[0] = False
    with pytest.raises(TimeoutError, match="unhealthy"):
        wait.receipt(reply)
    assert clock.now <= 0.5 and wait.receipts_abandoned == 1  # not 15 s, not twice that


def test_nobody_listening_ends_every_wait_whatever_the_heartbeat_says() -> None:
    for kind in ("reply", "receipt"):
        clock, gone = Clock(), [False]
        wait = policy(clock, [True], gone)
        reply = SlowReply(clock, None)

        def dies_at_2s(gone: list[bool] = gone, clock: Clock = clock) -> bool:
            gone[0] = gone[0] or clock.now >= 2.0
            return gone[0]

        wait.gone = dies_at_2s
        with pytest.raises(TimeoutError, match="nobody listens"):
            getattr(wait, kind)(reply)
        assert 2.0 <= clock.now <= 2.5, kind


def test_lmcaches_pickle_methods_are_the_ones_the_replacements_copy() -> None:
    from lmcache.v1.multiprocess.transfer_context.pickle import EngineDrivenContextPickle

    uninstall()
    expected = {
        "prepare_store": ["future = self.req_client.prepare_store(key, instance_id)",
                          "future.result(timeout=self.mq_timeout)", "return None"],
        "commit_store": ["serialised = pickle.dumps(chunks)",
                         "future = self.req_client.commit_store(key, instance_id, serialised)",
                         "return bool(future.result(timeout=self.mq_timeout))", "return False"],
        "prepare_retrieve": ["future = self.req_client.prepare_retrieve(key, instance_id)",
                             "response = future.result(timeout=self.mq_timeout)",
                             "if not response.success or not response.data:",
                             "chunks: list[torch.Tensor] = pickle.loads(response.data)"],
        "commit_retrieve": ["future = self.req_client.commit_retrieve(key, instance_id)",
                            "future.result(timeout=self.mq_timeout)", "return True"],
    }
    assert set(expected) == set(REPLACED)
    for name, lines in expected.items():
        source = inspect.getsource(getattr(EngineDrivenContextPickle, name))
        for line in lines:
            assert line in source, f"LMCache changed {name}: {line!r} is gone"
    try:
        assert install(ServerWait(lambda: True, base_s=1.0, max_s=1.0, dead_after_s=1.0))
        assert all(getattr(EngineDrivenContextPickle, name) is not None and
                   "kvpersist" in getattr(EngineDrivenContextPickle, name).__module__
                   for name in REPLACED)
    finally:
        uninstall()
    assert all(getattr(EngineDrivenContextPickle, name).__module__.startswith("lmcache")
               for name in REPLACED)


@pytest.mark.integration
def test_a_real_reply_past_the_base_timeout_is_waited_for_while_alive(
        settings: ServerSettings) -> None:
    """LMCache's own bench client (the same pickle transport as vLLM's worker) against a real
    server: a 1 ms base timeout, and the server paused for 0.5 s after the LOOKUP so the 8 MiB
    reply is late.  Alive: it is waited for and every byte checks out.  Dead (the heartbeat says
    so, and the server is stopped before the RETRIEVE, so no reply can beat the policy): it is
    given up, a failed load."""
    start_server(settings)
    stopped: list[int] = []
    blocks = 8192 // 16 + 16
    d = BenchDriver(settings.request_url, settings.http_url, "org/model/kvp-" + "d" * 32,
                    num_tokens=8192, num_blocks=blocks,
                    shape_spec=f"(2,{blocks},16,2,64):float16:2")  # 256 KiB per chunk
    try:
        sums = d.checksums(1)
        assert d.store(1)
        record = check_pid_file(settings.pid_file).record
        assert record is not None
        stopped.append(record.pid)

        def pause_server() -> None:  # the reply comes 0.5 s late, past the 1 ms base
            os.kill(record.pid, signal.SIGSTOP)
            threading.Timer(0.5, os.kill, (record.pid, signal.SIGCONT)).start()

        alive = ServerWait(lambda: True, base_s=0.001, max_s=60.0, dead_after_s=5.0)
        assert install(alive)
        trip = d.lookup_and_retrieve(1, sums, between=pause_server)
        assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (32, True, True)
        assert alive.extended == 1  # the reply came after the base timeout, and was taken
        dead = ServerWait(lambda: False, base_s=0.001, max_s=60.0, dead_after_s=0.0)
        assert install(dead)
        trip = d.lookup_and_retrieve(1, sums, between=lambda: os.kill(record.pid, signal.SIGSTOP))
        assert trip.hit_chunks == 32 and not trip.retrieved_ok  # given up: vLLM would recompute
        assert dead.abandoned == 1 and "unhealthy" in dead.last_reason
    finally:
        uninstall()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        d.close()


@pytest.mark.integration
def test_a_store_in_flight_when_the_server_dies_is_given_up_by_the_socket(
        settings: ServerSettings) -> None:
    """A store sent to a server that is then killed -9: LMCache's wait would last its timeout
    twice (prepare, commit); with the policy, the refused admin socket ends it.  The base
    timeout and the heartbeat are out of the way (an hour, always healthy), so only the dead
    socket can end the wait."""
    start_server(settings)
    d = BenchDriver(settings.request_url, settings.http_url, "org/model/kvp-" + "e" * 32,
                    num_tokens=1024)
    wait = ServerWait(lambda: True, gone=lambda: refuses_connections(settings.http_url),
                      base_s=3600.0, max_s=3600.0, dead_after_s=3600.0)
    record = check_pid_file(settings.pid_file).record
    assert record is not None
    try:
        assert d.store(1)  # a live server answers
        assert install(wait)
        assert not refuses_connections(settings.http_url)
        os.kill(record.pid, signal.SIGSTOP)  # the store below cannot be answered
        storing = threading.Thread(target=d.store, args=(2,), daemon=True)
        storing.start()
        # On purpose, not a condition: a window in which nothing may happen (the wait has no
        # "waiting" state to observe); the store is sent and its receipt waited for meanwhile.
        time.sleep(1.0)
        assert wait.receipts_abandoned == 0  # a stopped server still listens: waited for
        kill_server(settings)  # SIGKILL (of the stopped server); returns once it has exited
        wait_until(lambda: wait.receipts_abandoned >= 1, timeout=30.0)
        assert wait.last_reason == "nobody listens at the server's socket"
        assert refuses_connections(settings.http_url)
    finally:
        uninstall()
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)
        d.close()
