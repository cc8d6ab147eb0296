"""A local HTTP server for unit tests that stand a handler in for a real service's API.

Invariant: the server binds 127.0.0.1 on a free port, serves from a daemon thread only while
the ``with`` block runs, and is shut down when it ends, whatever the block raised.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def http_stub(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on loopback; yields the base URL (``http://127.0.0.1:PORT``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, name="http-stub", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
