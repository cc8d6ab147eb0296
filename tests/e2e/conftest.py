from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving.server.lifecycle import stop_server
from kvpersist.testing.helpers import server_env as make_server_env


@pytest.fixture
def server_env(tmp_path: Path) -> dict[str, str]:
    """Server settings on a fresh cache root with free loopback ports."""
    return make_server_env(tmp_path / "cache")


@pytest.fixture
def settings(server_env: dict[str, str]) -> Iterator[ServerSettings]:
    """Validated settings for ``server_env``; the server is stopped after the test."""
    s = load_settings(server_env)
    yield s
    stop_server(s)
