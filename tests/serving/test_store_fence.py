"""The store fence's rule with stand-in futures and processes: a preemption flush returns only
once every store settled or its server process is gone, with no timeout in between."""

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


def fence(process: Process | None, **kw: Any) -> StoreFence:
    return StoreFence(object(), server_url="unix:///nowhere", server_of=lambda f: process,
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
