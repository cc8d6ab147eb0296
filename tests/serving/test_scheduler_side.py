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


# --- run-time weight changes (the real patch of vLLM's EngineCore.collective_rpc)


def _prefetching() -> Any:
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState

    return LMCacheMPRequestState.PREFETCHING


@dataclass
class Tracker:
    """The parts of LMCache's request tracker the scheduler side reads and writes."""

    request_id: str
    max_offload_tokens: int = 1 << 20
    cache_salt: str = ""
    state: Any = field(default_factory=_prefetching)
    num_lmcache_hit_tokens: int = 0
    request_configs: Any = None

    def get_token_ids(self) -> list[int]:
        return []


@dataclass
class ReleasingAdapter(Adapter):
    released: list[str] = field(default_factory=list)
    lmcache_tokens_per_chunk: int = 256

    def cleanup_lookup_result(self, request_id: str) -> None:
        self.released.append(request_id)


@dataclass
class TrackingConnector(Connector):
    """LMCache's connector as the weight fence reads it: its trackers by request id."""

    request_trackers: dict[str, Tracker] = field(default_factory=dict)
    scheduler_adapter: Adapter = field(default_factory=ReleasingAdapter)

    def _get_or_create_request_tracker(self, request: Any) -> Any:
        return self.request_trackers.setdefault(request.request_id, Tracker(request.request_id))


@dataclass
class Executor:
    calls: list[Any] = field(default_factory=list)

    def collective_rpc(self, method: Any, *args: Any) -> list[Any]:
        self.calls.append(method)
        return []


@dataclass
class Metadata:
    requests: list[Any]


def test_a_collective_rpc_that_may_change_weights_ends_lookups_and_stores_before_it_runs(
        ) -> None:
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    from kvpersist.serving.lmcache_compat import engine_rpc

    connector = TrackingConnector()
    side = SchedulerSide(connector, ConnectorOptions(), identity=None,  # type: ignore[arg-type]
                         stats=KvPersistConnectorStats(), workers=1, attach_late=False)
    lmcache_adapters.key_new_trackers(connector, side.key_tracker)  # as the connector does
    keyed = Request("keyed-before")
    lmcache_adapters.tracker_of(connector, keyed)
    assert engine_rpc.watch_weight_changes(side.weights_changed)
    try:
        executor = Executor()
        engine = SimpleNamespace(model_executor=executor)
        seen_by_then: list[str | None] = []
        executor.collective_rpc = lambda method, *a: seen_by_then.append(  # type: ignore
            side.weights_changed_by)
        EngineCore.collective_rpc(engine, "compute_weight_checksums")  # type: ignore[arg-type]
        assert side.weights_changed_by is None  # reads leave caching on
        assert side.lookup(keyed, lambda: (512, False)) == (512, False)
        EngineCore.collective_rpc(engine, "reload_weights")  # type: ignore[arg-type]
        assert seen_by_then == [None, "reload_weights"]  # known before the RPC ran
        assert connector.request_trackers["keyed-before"].max_offload_tokens == 0
        # a request keyed before: no lookup now; LMCache's lookup is never asked
        asked: list[int] = []
        assert side.lookup(keyed, lambda: asked.append(1) or (512, False)) == (0, False)  # type: ignore
        assert asked == []
        # a new request is not cached at all, and the step's stores are dropped
        fresh = Request("after")
        assert side.lookup(fresh, lambda: asked.append(1) or (512, False)) == (0, False)  # type: ignore
        assert asked == [] and connector.request_trackers["after"].max_offload_tokens == 0
        metadata = Metadata([SimpleNamespace(direction="STORE"),
                             SimpleNamespace(direction="RETRIEVE")])
        side.drop_stores_after_weight_change(metadata)
        assert [r.direction for r in metadata.requests] == ["RETRIEVE"]
        assert side._stats.data["kvpersist_uncached_requests"]["weights_changed"] == 2
    finally:
        engine_rpc.stop_watching(side.weights_changed)


def test_any_callable_sent_as_a_collective_rpc_counts_as_a_weight_change() -> None:
    from kvpersist.serving.lmcache_compat import engine_rpc

    heard: list[str] = []
    assert engine_rpc.watch_weight_changes(heard.append)
    try:
        from types import SimpleNamespace

        from vllm.v1.engine.core import EngineCore

        engine = SimpleNamespace(model_executor=Executor())

        def load_my_weights(worker: Any) -> None:
            return None

        EngineCore.collective_rpc(engine, load_my_weights)  # type: ignore[arg-type]
        EngineCore.collective_rpc(engine, "update_weights")  # type: ignore[arg-type]
        EngineCore.collective_rpc(engine, "check_health")  # type: ignore[arg-type]
        assert heard == [load_my_weights.__qualname__, "update_weights"]
    finally:
        engine_rpc.stop_watching(heard.append)


def test_a_request_whose_key_derivation_raises_is_a_miss_not_a_crash() -> None:
    from kvpersist.serving.connector.request_keys import RequestKeys

    class Raising(RequestKeys):
        def key(self, request: Any) -> Any:
            raise RuntimeError("an input kvpersist cannot digest")

    connector = TrackingConnector()
    side = SchedulerSide(connector, ConnectorOptions(), identity=None,  # type: ignore[arg-type]
                         stats=KvPersistConnectorStats(), workers=1, attach_late=False,
                         keys=Raising(None))
    lmcache_adapters.key_new_trackers(connector, side.key_tracker)
    request = Request("odd")
    assert side.lookup(request, lambda: (256, False)) == (0, False)
    assert connector.request_trackers["odd"].max_offload_tokens == 0
    assert side._stats.data["kvpersist_uncached_requests"]["key_error"] == 1
