"""Late attach, unit level: the registration count read from a server's /status, and the watch
that turns the scheduler on only once every worker is listed.  (End to end with real processes:
tests/e2e/test_late_attach_e2e.py.)"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvpersist.serving.connector.scheduler.late_attach import RegistrationWatch
from kvpersist.serving.lmcache_compat.status import registrations

NS = "kvp-" + "1" * 32
OTHER = "kvp-" + "2" * 32


def status_with(*names: str) -> dict[str, Any]:
    return {"non_cuda_context_meta": {str(i): {"model_name": f"org/m/{n}", "world_size": 2}
                                      for i, n in enumerate(names)},
            "cache_context_meta": {}}


def test_registrations_count_only_this_namespace() -> None:
    assert registrations(status_with(NS, OTHER, NS), NS) == 2
    assert registrations(status_with(OTHER), NS) == 0
    assert registrations({}, NS) == 0
    assert registrations({"cache_context_meta": "garbage"}, NS) == 0


def test_watch_attaches_only_when_every_worker_is_registered() -> None:
    answers: list[Mapping[str, Any] | None] = [None, status_with(NS), status_with(NS, NS)]
    seen = threading.Event()

    def fetch(url: str, timeout: float) -> Mapping[str, Any] | None:
        return answers.pop(0) if answers else status_with(NS, NS)

    watch = RegistrationWatch("http://x/status", NS, workers=2, interval_s=3600,
                              fetch=fetch, on_attach=seen.set)
    try:
        watch.close()  # stop the background loop after its first poll; drive it by hand
        watch._thread.join(timeout=5)
        if not answers:  # the thread raced through every answer: it must have attached
            assert watch.attached
            return
        assert not watch.attached
        while answers and not watch.poll_once():
            pass
        assert watch.attached and seen.is_set() and not answers
    finally:
        watch.close()


def test_watch_keeps_polling_through_errors() -> None:
    calls = {"n": 0}

    def fetch(url: str, timeout: float) -> Mapping[str, Any] | None:
        calls["n"] += 1
        if calls["n"] < 3:
            raise OSError("boom")
        return status_with(NS)

    watch = RegistrationWatch("http://x/status", NS, workers=1, interval_s=0.01, fetch=fetch)
    try:
        assert watch.wait(10) and calls["n"] >= 3
    finally:
        watch.close()
        watch._thread.join(timeout=5)  # its last log line lands inside the test's capture
