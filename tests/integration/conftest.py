from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.server import stop_server
from kvpersist.settings import ServerSettings
from kvpersist.tiny_model import build_tiny_model

from helpers import kvpersist_settings


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[ServerSettings]:
    """A kvpersist-adapter server's settings on a fresh root; stopped after the test."""
    s = kvpersist_settings(tmp_path / "cache")
    yield s
    stop_server(s)
