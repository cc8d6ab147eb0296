"""The scheduler side's reading of LMCache's lookup answers
(:class:`kvpersist.serving.connector.scheduler.side.SchedulerSide`), with stand-ins for LMCache's
connector and scheduler adapter (our own logic; the e2e tests run it against the real ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.client import ConnectorOptions
from kvpersist.serving.connector.metrics import KvPersistConnectorStats
from kvpersist.serving.connector.scheduler.side import LookupResult, SchedulerSide
from kvpersist.serving.lmcache_compat import adapters as lmcache_adapters


@dataclass
class Adapter:
    """LMCache's scheduler adapter as the scheduler side reads it: a heartbeat flag."""

    is_healthy: bool = True
    _heartbeat_interval: float = 2.0


@dataclass
class Connector:
    scheduler_adapter: Adapter = field(default_factory=Adapter)
    trackers: dict[str, Any] = field(default_factory=dict)

    def _get_or_create_request_tracker(self, request: Any) -> Any:
        return self.trackers.setdefault(request.request_id, type("Tracker", (), {})())


@dataclass
class Request:
    request_id: str = "chat-1"


def scheduler_side() -> tuple[SchedulerSide, Connector, Request]:
    connector = Connector()
    side = SchedulerSide(connector, ConnectorOptions(), identity=None,  # type: ignore[arg-type]
                         stats=KvPersistConnectorStats(), workers=1, attach_late=False)
    request = Request()
    lmcache_adapters.mark_tracker(connector._get_or_create_request_tracker(request), "keyed")
    return side, connector, request


def test_a_zero_given_while_the_heartbeat_turned_unhealthy_is_not_an_answer() -> None:
    side, connector, request = scheduler_side()
    adapter = connector.scheduler_adapter

    def missed_beat_mid_call() -> LookupResult:
        adapter.is_healthy = False  # the beat is missed between kvpersist's check and LMCache's
        return 0, False  # LMCache's unhealthy branch: 0 without asking the server

    assert side.lookup(request, missed_beat_mid_call) == (None, False)
    assert side.deadline.pending == 1  # still waited for, under the deadline
    # unhealthy: waits without asking LMCache (which would answer 0 again)
    assert side.lookup(request, lambda: (0, False)) == (None, False)
    adapter.is_healthy = True  # the next beat is answered: the restore's hits count
    assert side.lookup(request, lambda: (1792, True)) == (1792, True)
    assert side.deadline.pending == 0
    side.close()


def test_a_zero_while_healthy_is_a_miss() -> None:
    side, _connector, request = scheduler_side()
    assert side.lookup(request, lambda: (None, True)) == (None, True)  # still loading
    assert side.lookup(request, lambda: (0, False)) == (0, False)
    assert side.deadline.pending == 0
    side.close()
