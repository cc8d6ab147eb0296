"""LMCache's server endpoints moved onto Unix-domain sockets: its request server (ZMQ) is built
with ``ipc://<path>``, and its admin API (uvicorn) is handed a listening socket, never a host
and port.

LMCache 0.5.6 builds both from ``--host``/``--port`` inside ``build_zmq_request_server`` and
``run_http_server``; this module re-binds the two names those functions look up
(``MessageQueueServer`` in the ZMQ server module, ``uvicorn`` in the HTTP server module).

Invariants
----------
* Installed only when the ``unix_endpoints`` pins match (:mod:`.pins`); otherwise
  :class:`EndpointsError` is raised and nothing is changed, so a server asked for sockets never
  falls back to TCP.
* ``before_bind`` runs before the request socket is bound, ``after_bind`` after (the caller
  clears a stale socket and sets modes there).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from . import pins

FEATURE = "unix_endpoints"


class EndpointsError(RuntimeError):
    """LMCache's endpoint construction is not the one this module re-binds."""


def install(request_socket: Path, http_listener: socket.socket, *,
            before_bind: Callable[[], None], after_bind: Callable[[], None]) -> None:
    """Make LMCache's server listen on ``request_socket`` and ``http_listener``."""
    if not pins.available(FEATURE):
        raise EndpointsError("LMCache's endpoint construction changed (see the line above); "
                             "refusing to start rather than listen on TCP")
    import uvicorn
    from lmcache.v1.multiprocess import http_server
    from lmcache.v1.multiprocess.transport.zmq_impl import server as zmq_server

    base_queue_server: Any = zmq_server.MessageQueueServer

    class UnixMessageQueueServer(base_queue_server):  # type: ignore[misc, valid-type]
        def __init__(self, bind_url: str, context: Any) -> None:
            before_bind()
            super().__init__(f"ipc://{request_socket}", context)
            after_bind()

    zmq_server.MessageQueueServer = UnixMessageQueueServer  # type: ignore[misc]

    class UnixSocketConfig(uvicorn.Config):
        def __init__(self, app: Any, **kwargs: Any) -> None:
            kwargs.pop("host", None)
            kwargs.pop("port", None)
            super().__init__(app, fd=http_listener.fileno(), **kwargs)

    http_server.uvicorn = SimpleNamespace(  # type: ignore[attr-defined]
        Config=UnixSocketConfig, Server=uvicorn.Server)
