"""The worker's wait for a restore's KV: a long reply from a live server is waited for, a dead
server is given up on, and LMCache's replaced method is still the one this was written for."""

from __future__ import annotations

import inspect

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.serving.server import start_server
from kvpersist.serving.transfer_wait import ReplyWait, install, uninstall
from kvpersist.testing.lmcache_bench import BenchDriver


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


def policy(clock: Clock, alive: list[bool]) -> ReplyWait:
    return ReplyWait(lambda: alive[0], base_s=15.0, max_s=600.0, dead_after_s=6.0,
                     poll_s=0.25, clock=clock)


def test_a_reply_within_the_base_timeout_is_taken_as_lmcache_would() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    assert wait.result(SlowReply(clock, 3.0)) == "reply" and wait.extended == 0


def test_a_long_reply_from_a_live_server_is_waited_for() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    assert wait.result(SlowReply(clock, 95.0)) == "reply"  # 2 GiB pickled on CPU: minutes
    assert wait.extended == 1 and clock.now == pytest.approx(95.0)


def test_a_heartbeat_flap_does_not_end_the_wait_but_a_dead_server_does() -> None:
    clock, alive = Clock(), [True]
    wait = policy(clock, alive)
    reply = SlowReply(clock, 40.0)

    def flapping() -> bool:  # unhealthy for 4 s around t=20, then healthy again
        return not 20.0 <= clock.now < 24.0

    wait.alive = flapping
    assert wait.result(reply) == "reply"
    clock2 = Clock()
    dead = policy(clock2, [False])
    with pytest.raises(TimeoutError):
        dead.result(SlowReply(clock2, None))
    # given up 6 s (dead_after_s) after the base 15 s, not at the 600 s ceiling
    assert 21.0 <= clock2.now <= 21.5 and dead.abandoned == 1


def test_the_ceiling_holds_for_a_live_server_that_never_answers() -> None:
    clock = Clock()
    wait = policy(clock, [True])
    with pytest.raises(TimeoutError):
        wait.result(SlowReply(clock, None))
    assert clock.now == pytest.approx(600.0, abs=0.5)


def test_lmcaches_pickle_retrieve_is_the_one_the_replacement_copies() -> None:
    from lmcache.v1.multiprocess.transfer_context.pickle import EngineDrivenContextPickle

    method = EngineDrivenContextPickle.prepare_retrieve
    if method.__qualname__ == "kvpersist.prepare_retrieve":  # installed by an earlier test here
        pytest.skip("already replaced in this process")
    source = inspect.getsource(method)
    for line in ("future = self.req_client.prepare_retrieve(key, instance_id)",
                 "response = future.result(timeout=self.mq_timeout)",
                 "if not response.success or not response.data:",
                 "chunks: list[torch.Tensor] = pickle.loads(response.data)"):
        assert line in source, f"LMCache changed prepare_retrieve: {line!r} is gone"


@pytest.mark.integration
def test_a_real_reply_past_the_base_timeout_is_waited_for_while_alive(
        settings: ServerSettings) -> None:
    """LMCache's own bench client (the same pickle transport as vLLM's worker) against a real
    server: with a 1 ms base timeout, the 8 MiB reply is always late.  Alive: it is waited for
    and every byte checks out.  Dead (the heartbeat says so): it is given up, a failed load."""
    start_server(settings)
    blocks = 8192 // 16 + 16
    d = BenchDriver(settings.request_url, settings.http_url, "org/model/kvp-" + "d" * 32,
                    num_tokens=8192, num_blocks=blocks,
                    shape_spec=f"(2,{blocks},16,2,64):float16:2")  # 256 KiB per chunk
    try:
        sums = d.checksums(1)
        assert d.store(1)
        alive = ReplyWait(lambda: True, base_s=0.001, max_s=60.0, dead_after_s=5.0)
        assert install(alive)
        trip = d.lookup_and_retrieve(1, sums)
        assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (32, True, True)
        assert alive.extended == 1  # the reply came after the base timeout, and was taken
        dead = ReplyWait(lambda: False, base_s=0.001, max_s=60.0, dead_after_s=0.0)
        assert install(dead)
        trip = d.lookup_and_retrieve(1, sums)
        assert trip.hit_chunks == 32 and not trip.retrieved_ok  # given up: vLLM would recompute
        assert dead.abandoned == 1
    finally:
        uninstall()
        d.close()
