"""The L1 window's hooks keep what LMCache's server needs of its handlers (see
:mod:`kvpersist.serving.lmcache_compat.l1_window`; its pinned sources are checked in
``test_lmcache_compat.py``)."""

from __future__ import annotations

import inspect

from kvpersist.serving.lmcache_compat import l1_window
from kvpersist.serving.lmcache_compat.l1_window.route import add_served_route


def test_the_hooks_keep_lmcache_handler_registration() -> None:
    """Wrapped request handlers still validate against LMCache's RPC specs (a handler that
    lost its attributes or signature would silently drop the operation from the server)."""
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ld
    from lmcache.v1.multiprocess.modules import lookup as lk
    from lmcache.v1.multiprocess.request_handler import (
        get_request_handler_options,
        validate_handler,
    )

    saved = {(cls, name): getattr(cls, name) for cls, name in [
        (lk.LookupModule, "lookup"), (lk.LookupModule, "_consume_prefetch_result"),
        (lk.LookupModule, "free_lookup_locks"), (lk.LookupModule, "end_session"),
        (ld.LMCacheDrivenTransferModule, "retrieve"),
        (ld.LMCacheDrivenTransferModule, "register_kv_cache")]}
    from lmcache.v1.distributed import storage_manager as sm
    from lmcache.v1.multiprocess.modules import engine_driven_transfer as ed
    saved[(sm.StorageManager, "__init__")] = sm.StorageManager.__init__
    saved[(ed.EngineDrivenTransferModule, "register_kv_cache_engine_driven_context")] = (
        ed.EngineDrivenTransferModule.register_kv_cache_engine_driven_context)
    try:
        l1_window.install(1 << 30)
        for cls, name in saved:
            if name.startswith("_"):
                continue
            handler = getattr(cls, name)
            assert handler is not saved[(cls, name)]
            options = get_request_handler_options(handler)
            assert options is not None, name
            validate_handler(options.operation or name, handler)
    finally:
        for (cls, name), original in saved.items():
            setattr(cls, name, original)


def test_the_served_prefix_route_answers_on_lmcache_http_app() -> None:
    """The route a worker asks after a failed retrieve, on LMCache's own FastAPI app, with
    a request id as vLLM spells them (quoted by the worker)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    window = l1_window.WindowState(2**20)
    add_served_route(window, app)
    client = TestClient(app)
    assert client.get("/kvpersist/restores/7/chatcmpl-a%2Fb").status_code == 404
    window.served.record("chatcmpl-a/b", 7, 3)
    answer = client.get("/kvpersist/restores/7/chatcmpl-a%2Fb")
    assert answer.status_code == 200
    assert answer.json() == {"request_id": "chatcmpl-a/b", "instance_id": 7, "served_chunks": 3}
    assert client.get("/kvpersist/restores/8/chatcmpl-a%2Fb").status_code == 404


def test_lmcache_serves_its_http_api_from_the_app_the_route_is_added_to() -> None:
    from lmcache.v1.multiprocess import http_server

    assert "uvicorn.Config(\n        app=app," in inspect.getsource(http_server.run_http_server)
    assert callable(http_server.app.add_api_route)
