"""A real GlusterFS volume mounted twice (two nodes' mounts of one tree), and the settings of a
kvpersist server per node; servers are stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving.server.lifecycle import stop_server
from kvpersist.testing import glusterfs
from kvpersist.testing.lmcache_bench import BenchDriver

MODEL = "org/model/kvp-" + "c" * 32


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[glusterfs.GlusterVolume]:
    with glusterfs.machine_turn():  # the other GlusterFS module may run on the other worker
        reason = glusterfs.unavailable()
        if reason is not None:
            pytest.skip(f"no GlusterFS here: {reason}")
        with glusterfs.gluster_volume(tmp_path_factory.mktemp("gluster"), mounts=2) as vol:
            yield vol


class Nodes:
    """Node ``a`` on mount 0 and node ``b`` on mount 1 of one tree; servers stopped at the end."""

    def __init__(self, volume: glusterfs.GlusterVolume, local: Path, tree: str,
                 **extra: str) -> None:
        self.settings: dict[str, ServerSettings] = {}
        self.env: dict[str, dict[str, str]] = {}
        for name, mount in zip("ab", volume.mounts, strict=True):
            env = {"KVP_CACHE_ROOT": str(mount / tree), "KVP_NODE_ID": name,
                   "KVP_SHARED_NODES": "2", "KVP_RUNTIME_DIR": str(local / f"run-{name}"),
                   "KVP_L1_SIZE_GB": "1", "KVP_CACHE_BUDGET_GB": "1", **extra}
            self.env[name] = env
            self.settings[name] = load_settings(environ=env)

    def __getitem__(self, name: str) -> ServerSettings:
        return self.settings[name]

    def driver(self, name: str) -> BenchDriver:
        s = self.settings[name]
        return BenchDriver(s.request_url, s.http_url, MODEL)

    def stop(self) -> None:
        for s in self.settings.values():
            stop_server(s)


@pytest.fixture
def nodes(volume: glusterfs.GlusterVolume, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[Nodes]:
    n = Nodes(volume, tmp_path, request.node.name[:40])
    yield n
    n.stop()
