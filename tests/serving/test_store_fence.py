"""The store fence's rules with stand-in futures and processes: a preemption flush returns only
once every store settled or its server process is gone, with no timeout in between; a finished
request is reported finished sending (its blocks freed) only once its last store settled, shown
on LMCache 0.5.6's own ``get_finished`` code."""

from __future__ import annotations

import threading
import time
from typing import Any

from kvpersist.serving.connector.worker.store_fence import StoreFence


class Future:
    """LMCache's MessagingFuture as the fence uses it: query() and wait(timeout)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class Process:
    def __init__(self) -> None:
        self.exited = False

    def gone(self) -> bool:
        return self.exited

    def __str__(self) -> str:
        return "pid 4242"


def fence(process: Process | None, adapter: Any = None, **kw: Any) -> StoreFence:
    return StoreFence(adapter if adapter is not None else object(),
                      server_url="unix:///nowhere", server_of=lambda f: process,
                      listener=lambda url: process, refuses=lambda url: False, **kw)


def settle_in_thread(f: StoreFence, futures: list[Future]) -> threading.Thread:
    t = threading.Thread(target=f.settle, args=(futures,), daemon=True)
    t.start()
    return t


def test_a_flush_waits_for_a_live_server_past_every_timeout() -> None:
    server, store = Process(), Future()
    f = fence(server, report_every_s=0.2)
    waiting = settle_in_thread(f, [store])
    time.sleep(1.5)  # far past report_every_s and the fence's poll: still holding the blocks
    assert waiting.is_alive()
    store.set()
    waiting.join(5)
    assert not waiting.is_alive() and f.given_up == 0 and f.flushes == 1


def test_a_store_whose_server_process_is_gone_is_given_up() -> None:
    server, store = Process(), Future()
    recorded: list[tuple[str, int]] = []
    f = fence(server, record=lambda reason, n: recorded.append((reason, n)))
    waiting = settle_in_thread(f, [store, Future()])
    time.sleep(0.5)
    assert waiting.is_alive()
    server.exited = True  # the process that took the store can neither read nor publish
    waiting.join(5)
    assert not waiting.is_alive() and f.given_up == 2 and recorded == [("server_gone", 2)]


def test_an_unnamed_server_is_given_up_only_when_its_socket_refuses() -> None:
    refused = threading.Event()
    f = StoreFence(object(), server_url="http://127.0.0.1:1", server_of=lambda fut: None,
                   listener=lambda url: None, refuses=lambda url: refused.is_set())
    waiting = settle_in_thread(f, [Future()])
    time.sleep(0.5)
    assert waiting.is_alive()
    refused.set()
    waiting.join(5)
    assert not waiting.is_alive() and f.given_up == 1


def test_settled_stores_return_at_once() -> None:
    done = Future()
    done.set()
    f = fence(Process())
    f.settle([done])
    assert f.flushes == 0 and f.given_up == 0


class Telemetry:
    def on_request_store_finished(self, **_kw: Any) -> None:
        pass


def lmcache_worker(futures: dict[str, Future]) -> Any:
    """An object run by LMCache 0.5.6's own ``get_finished`` and its helpers: the state its
    worker adapter keeps for stores, and nothing else (no retrieves, healthy)."""
    from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter

    class Worker:
        get_finished = LMCacheMPWorkerAdapter.get_finished
        _process_finished_stores = LMCacheMPWorkerAdapter._process_finished_stores
        _update_and_get_finished_store = LMCacheMPWorkerAdapter._update_and_get_finished_store

        def __init__(self) -> None:
            self.dispatcher = None
            self.is_healthy = True
            self.store_futures: dict[str, Any] = futures
            self.store_events: dict[str, Any] = {}
            self.retrieve_futures: dict[str, Any] = {}
            self.retrieve_events: dict[str, Any] = {}
            self._dropped_retrieves: set[str] = set()
            self._pending_store_kv_events: dict[str, Any] = {}
            self.finished_stores: set[str] = set()
            self.previously_finished: set[str] = set()
            self._returned_finished: set[str] = set()
            self.request_telemetry = Telemetry()
            self.model_name, self.world_size, self.worker_id = "m", 1, 0

        def _publish_store_kv_events(self, request_id: str) -> None:
            pass

        def handle_preemptions(self, need_flush: bool) -> None:
            pass

    return Worker()


class Settled(Future):
    def __init__(self) -> None:
        super().__init__()
        self.set()

    def result(self, timeout: float | None = None) -> bool:
        return True


def two_stores_then_finish(worker: Any) -> tuple[Any, Future]:
    """Request R's first store settles and is seen; its second (the last prefill step's) is
    sent and still read when the engine finishes R."""
    worker.store_futures["R"] = Settled()
    assert worker.get_finished(set()) == (set(), set())  # R not finished yet: nothing to say
    last = Future()
    worker.store_futures["R"] = last
    return worker.get_finished({"R"}), last


def test_lmcache_alone_reports_a_request_finished_while_its_last_store_is_read() -> None:
    """The hole the fence closes, in LMCache 0.5.6's own code: R is reported finished sending
    (vLLM frees its blocks) although its last store has not settled."""
    (sending, _), last = two_stores_then_finish(lmcache_worker({}))
    assert not last.query() and sending == {"R"}


def test_the_fence_reports_a_finished_request_only_once_its_last_store_settled() -> None:
    worker = lmcache_worker({})
    f = fence(Process(), worker)
    f.install()
    (sending, _), last = two_stores_then_finish(worker)
    assert sending == set() and f.finishes_withheld == 1
    assert worker.get_finished(set())[0] == set()  # still read: still held
    last.result = lambda timeout=None: True  # type: ignore[method-assign]
    last.set()
    assert worker.get_finished(set())[0] == {"R"}  # settled: reported once, now
    assert worker.get_finished(set())[0] == set()


def test_a_withheld_request_whose_server_is_gone_is_released() -> None:
    process = Process()
    worker = lmcache_worker({})
    f = fence(process, worker, clock=iter(range(0, 100, 2)).__next__)
    f.install()
    (sending, _), _last = two_stores_then_finish(worker)
    assert sending == set()
    assert worker.get_finished(set())[0] == set()  # the server lives: held
    process.exited = True
    assert worker.get_finished(set())[0] == {"R"} and f.given_up == 1
