"""http.refuses_connections, the worker's certain sign of a dead server: True only when nobody
listens (refused, or the Unix socket file gone), over TCP and over a Unix socket."""

from __future__ import annotations

import socket
import urllib.parse
from pathlib import Path

import pytest

from kvpersist.demo.stack import free_port
from kvpersist.serving.http import UNIX_SCHEME, refuses_connections


@pytest.mark.serial  # a free port must stay free until the test binds it
def test_tcp_listener_and_none() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/status"
        assert not refuses_connections(url)  # accepted (into the backlog): alive
    assert refuses_connections(f"http://127.0.0.1:{free_port()}/status")


def test_unix_socket_listening_closed_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "http.sock"
    url = UNIX_SCHEME + urllib.parse.quote(str(path), safe="") + "/status"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    assert not refuses_connections(url)
    listener.close()  # the process is gone, its socket file stays (a kill -9)
    assert path.exists() and refuses_connections(url)
    path.unlink()  # removed by `kvp-server stop`
    assert refuses_connections(url)
