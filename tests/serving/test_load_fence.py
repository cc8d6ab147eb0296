"""The load fence's rules, run on LMCache 0.5.6's own ``get_finished`` code.

The adapter is LMCache's real :class:`LMCacheMPWorkerAdapter` class with only the state its
``get_finished`` reads (no server, no vLLM), and the transfers are LMCache's real
``MessagingFuture`` objects: settling one is what LMCache's messaging thread does when the
server's reply arrives.  So these tests also fail when LMCache changes what the fence relies
on.  The fence with real processes is ``tests/e2e/test_load_fence_e2e.py``.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest
from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter
from lmcache.v1.multiprocess.futures import MessagingFuture

from kvpersist.serving.connector.metrics import KvPersistConnectorStats
from kvpersist.serving.connector.worker.load_fence import LoadFence
from kvpersist.serving.connector.worker.served_prefix import ServedPrefixKeeper
from kvpersist.serving.connector.worker.server_process import ServerProcess
from kvpersist.serving.lmcache_compat.adapters import FINISHED_METHODS


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def adapter(*, healthy: bool = True, lazy: bool = False) -> Any:
    """LMCache's worker adapter with the state its get_finished variants use."""
    a = object.__new__(LMCacheMPWorkerAdapter)
    a._health_event = threading.Event()
    if healthy:
        a._health_event.set()
    a.dispatcher = None
    a.lazy_offload = lazy
    a.store_futures, a.retrieve_futures = {}, {}
    a.store_events, a.retrieve_events = {}, {}
    a._pending_store_kv_events = {}
    a._dropped_retrieves, a._failed_request_ids, a.error_block_ids = set(), set(), set()
    a.finished_stores, a.previously_finished, a._returned_finished = set(), set(), set()
    a._completed_store_requests, a._failed_store_requests = {}, set()

    class Telemetry:
        def on_request_store_finished(self, **_: Any) -> None:
            return None

    a.request_telemetry = Telemetry()
    a.model_name = "m"

    class Strategy:
        kv_world_size, kv_worker_id, is_kv_writer = 1, 0, True

    a.parallel_strategy = Strategy()
    return a


def retrieve(a: Any, rid: str, blocks: list[int]) -> MessagingFuture[Any]:
    future: MessagingFuture[Any] = MessagingFuture()
    a.retrieve_futures[rid] = (future, blocks)
    return future


class World:
    """A server process and its socket, as the fence sees them."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = ServerProcess(4242, 7)
        self.dead: set[ServerProcess] = set()
        self.refusing = False

    def listener(self, _url: str | None) -> ServerProcess | None:
        return self.server

    def refuses(self, _url: str) -> bool:
        return self.refusing


def fenced(a: Any, world: World, clock: Clock | None = None
           ) -> tuple[LoadFence, KvPersistConnectorStats]:
    stats = KvPersistConnectorStats()
    fence = LoadFence(a, server_url="http+unix://%2Frun%2Fx.sock", listener=world.listener,
                      refuses=world.refuses, record=stats.record_failed_load,
                      clock=clock or Clock())
    fence.install()
    return fence, stats


@pytest.fixture(autouse=True)
def gone_by_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """ServerProcess.gone() looks at /proc; here a world decides, per test."""
    monkeypatch.setattr(ServerProcess, "gone", lambda self: self in DEAD)
    DEAD.clear()


DEAD: set[ServerProcess] = set()


def test_without_the_fence_lmcache_reports_a_restore_in_flight_as_failed() -> None:
    """The fault the fence exists for, on LMCache's own code: one missed beat and a restore
    the server is still writing is handed back to vLLM, which recomputes into its blocks."""
    a = adapter()
    retrieve(a, "r1", [3, 4])
    a._health_event.clear()
    _sending, receiving = a.get_finished(set())
    assert receiving == {"r1"} and a.error_block_ids == {3, 4}


def test_a_restore_in_flight_is_held_while_the_heartbeat_says_unhealthy() -> None:
    a = adapter()
    future = retrieve(a, "r1", [3, 4])
    fence, _ = fenced(a, World())
    assert a.get_finished(set()) == (set(), set())  # healthy, in flight: LMCache waits too
    a._health_event.clear()
    for _ in range(3):
        assert a.get_finished(set()) == (set(), set())
    assert a.error_block_ids == set() and "r1" in a.retrieve_futures
    assert fence.held_total == 1

    future.set_result(True)  # the busy server finishes its write and answers
    assert a.get_finished(set()) == (set(), {"r1"})
    assert a.error_block_ids == set(), "a restore the server finished is a hit, not a recompute"


def test_a_restore_the_server_answers_as_failed_is_recomputed_after_the_answer() -> None:
    a = adapter(healthy=False)
    future = retrieve(a, "r1", [5])
    _, stats = fenced(a, World())
    assert a.get_finished(set()) == (set(), set())
    future.set_result(False)
    assert a.get_finished(set()) == (set(), {"r1"}) and a.error_block_ids == {5}
    assert stats.data["kvpersist_failed_loads"] == {"server_error": 1}


def test_a_restore_whose_server_exited_is_released_as_failed() -> None:
    a = adapter()
    world = World()
    retrieve(a, "r1", [1, 2])
    _, stats = fenced(a, world)
    assert a.get_finished(set()) == (set(), set())  # tagged with the server's process
    a._health_event.clear()
    assert a.get_finished(set()) == (set(), set())  # unhealthy, process alive: held
    assert world.server is not None
    DEAD.add(world.server)
    _sending, receiving = a.get_finished(set())
    assert receiving == {"r1"} and a.error_block_ids == {1, 2}
    assert a.retrieve_futures == {}
    assert stats.data["kvpersist_failed_loads"] == {"server_gone": 1}


def test_a_new_server_on_the_socket_does_not_release_the_old_ones_transfer_too_early() -> None:
    """The transfer belongs to the process it was sent to: a successor that answers the
    heartbeat never heard of it, so the transfer is released because its own server exited,
    and only then, even though the heartbeat is healthy again."""
    a = adapter()
    world = World()
    retrieve(a, "r1", [9])
    clock = Clock()
    fenced(a, world, clock)
    a.get_finished(set())
    old = world.server
    assert old is not None
    world.server = ServerProcess(5151, 8)  # the successor answers beats from now on
    clock.now += 5
    assert a.get_finished(set()) == (set(), set()), "the old server still runs: held"
    DEAD.add(old)
    clock.now += 0.5
    assert a.get_finished(set()) == (set(), set()), "healthy: looked at once a second"
    clock.now += 0.6
    assert a.get_finished(set()) == (set(), {"r1"}) and a.error_block_ids == {9}


def test_an_unnamed_server_is_taken_for_gone_only_when_its_socket_refuses() -> None:
    a = adapter(healthy=False)
    world = World()
    world.server = None  # a TCP admin URL: the kernel does not name the listener
    retrieve(a, "r1", [1])
    fenced(a, world)
    assert a.get_finished(set()) == (set(), set())
    world.refusing = True
    assert a.get_finished(set()) == (set(), {"r1"})
    world.refusing = False  # a later server on the socket: the released transfer stays released
    retrieve(a, "r2", [2])
    assert a.get_finished(set()) == (set(), set()), "a transfer to the new server is held"


def test_a_store_in_flight_keeps_its_blocks_until_the_server_read_them() -> None:
    """A store is the server reading vLLM's KV memory: blocks freed early would be stored under
    another prompt's key, a wrong hit later.  The engine's finished request is reported only
    once the server answered."""
    a = adapter()
    store: MessagingFuture[Any] = MessagingFuture()
    a.store_futures["s1"] = store
    fenced(a, World())
    a._health_event.clear()
    assert a.get_finished({"s1"}) == (set(), set())
    assert a.get_finished(set()) == (set(), set())
    store.set_result(True)
    assert a.get_finished(set()) == ({"s1"}, set())


def test_a_load_never_sent_is_reported_at_once_and_counted() -> None:
    a = adapter(healthy=False)
    a._dropped_retrieves.add("r1")
    a._failed_request_ids.add("r1")
    _, stats = fenced(a, World())
    assert a.get_finished(set()) == (set(), {"r1"})
    assert stats.data["kvpersist_failed_loads"] == {"unhealthy_at_submit": 1}


def test_the_lazy_offload_variant_is_fenced_too() -> None:
    a = adapter(healthy=False, lazy=True)
    future = retrieve(a, "r1", [7])
    fenced(a, World())
    assert a.get_finished_with_lazy_offload() == (None, set())
    future.set_result(True)
    assert a.get_finished_with_lazy_offload() == (None, {"r1"})
    assert a.error_block_ids == set()


def test_lmcache_still_has_what_the_fence_relies_on() -> None:
    for name in FINISHED_METHODS:
        assert callable(getattr(LMCacheMPWorkerAdapter, name))
    assert isinstance(LMCacheMPWorkerAdapter.is_healthy, property)
    a = adapter()
    for attr in ("retrieve_futures", "store_futures", "retrieve_events", "store_events",
                 "_pending_store_kv_events", "_dropped_retrieves", "_failed_request_ids"):
        assert hasattr(a, attr)


class ServerRecords:
    """What the server's admin route answers: request id -> chunks served, for instance 9."""

    def __init__(self, **served: int) -> None:
        self.served = served
        self.asked: list[str] = []

    def __call__(self, url: str) -> dict[str, Any] | None:
        self.asked.append(url)
        instance, rid = url.split("/kvpersist/restores/", 1)[1].split("/", 1)
        if rid not in self.served or instance != "9":
            return None
        return {"request_id": rid, "instance_id": 9, "served_chunks": self.served[rid]}


def kept(a: Any, records: ServerRecords) -> LoadFence:
    a.instance_id, a.blocks_in_chunk, a.engine_group_infos = 9, 2, []
    fence = LoadFence(a, server_url="http+unix://%2Frun%2Fx.sock", listener=World().listener,
                      refuses=World().refuses,
                      keeper=ServedPrefixKeeper(a, "http+unix://%2Frun%2Fx.sock", records))
    fence.install()
    return fence


def test_a_restore_failed_mid_stream_keeps_the_chunks_the_server_wrote() -> None:
    a = adapter()
    records = ServerRecords(r1=2)
    kept(a, records)
    retrieve(a, "r1", [10, 11, 12, 13, 14, 15]).set_result(False)  # 3 chunks, failed at the 3rd
    assert a.get_finished(set()) == (set(), {"r1"})
    assert a.get_block_ids_with_load_errors() == {14, 15}
    assert records.asked == ["http+unix://%2Frun%2Fx.sock/kvpersist/restores/9/r1"]


def test_without_a_record_of_the_server_the_whole_restore_is_recomputed() -> None:
    a = adapter()
    records = ServerRecords(other=2)
    kept(a, records)
    retrieve(a, "r1", [10, 11, 12, 13]).set_result(False)
    retrieve(a, "r2", [20, 21]).set_result(True)  # a hit: never asked about
    a.get_finished(set())
    assert a.get_block_ids_with_load_errors() == {10, 11, 12, 13}
    assert [u.rsplit("/", 1)[1] for u in records.asked] == ["r1"]


def test_a_multi_group_engine_or_a_record_covering_everything_keeps_nothing() -> None:
    a = adapter()
    kept(a, ServerRecords(r1=1, r2=9))
    a.engine_group_infos = [object(), object()]
    retrieve(a, "r1", [10, 11, 12, 13]).set_result(False)
    a.get_finished(set())
    assert a.get_block_ids_with_load_errors() == {10, 11, 12, 13}
    a.engine_group_infos = []
    retrieve(a, "r2", [20, 21]).set_result(False)
    a.get_finished(set())
    assert a.get_block_ids_with_load_errors() == {20, 21}


def test_a_restore_of_a_gone_server_is_never_asked_about() -> None:
    a = adapter()
    records = ServerRecords(r1=1)
    kept(a, records)
    world_server = ServerProcess(4242, 7)
    retrieve(a, "r1", [10, 11, 12, 13])
    DEAD.add(world_server)
    a._health_event.clear()
    a.get_finished(set())
    assert a.get_block_ids_with_load_errors() == {10, 11, 12, 13} and records.asked == []


def test_lmcache_still_has_what_the_served_prefix_relies_on() -> None:
    """The keeper reads these worker-adapter attributes and edits ``error_block_ids``, which
    LMCache's ``get_finished`` fills with every block of a failed retrieve and
    ``get_block_ids_with_load_errors`` hands to vLLM."""
    source = inspect.getsource(LMCacheMPWorkerAdapter)
    for assignment in ("self.instance_id: int =", "self.blocks_in_chunk =",
                       "self.engine_group_infos =", "self.error_block_ids: set[int] = set()"):
        assert assignment in source, assignment
    finished = inspect.getsource(LMCacheMPWorkerAdapter.get_finished)
    assert "self.error_block_ids.update(r_block_ids)" in finished
    a = adapter()
    a.error_block_ids = {1, 2}
    assert a.get_block_ids_with_load_errors() == {1, 2} and a.error_block_ids == set()
