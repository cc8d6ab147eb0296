from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.server import stop_server
from kvpersist.settings import ServerSettings, load_settings
from kvpersist.tiny_model import build_tiny_model

from helpers import server_env as make_server_env


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"))


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
