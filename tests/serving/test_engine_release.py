"""A CPU engine's KV mapping leaves the server's address space once released
(:mod:`kvpersist.serving.lmcache_compat.engine_release`), on LMCache's real shared-memory
wrapper: LMCache 0.5.6 alone keeps every mapping ``to_tensor`` makes until the process exits;
with the pin dropped, the last view's death unmaps it.  An engine whose process is gone is
found by pid and start time and unregistered through LMCache's own method."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

from kvpersist.serving.lmcache_compat import engine_release, pins

pytestmark = pytest.mark.skipif(not pins.available(engine_release.FEATURE),
                                reason="LMCache's pinned sources changed")


def mappings_of(name: str) -> int:
    """How many mappings of /dev/shm/``name`` this process holds."""
    path = "/dev/shm/" + name.lstrip("/")
    return sum(line.rstrip().endswith(path) for line in Path("/proc/self/maps").open())


@pytest.fixture
def segment() -> Any:
    """An engine's KV tensor migrated to shared memory, and the wrapper the server decodes."""
    kv = torch.zeros(1 << 20, dtype=torch.uint8)  # the engine's: its segment lives with it
    engine_side = CpuShmTensorWrapper.wrap(kv)
    server_side = CpuShmTensorWrapper.from_wire(engine_side.to_wire())
    yield server_side
    del kv
    gc.collect()
    Path("/dev/shm/" + engine_side.shm_name.lstrip("/")).unlink(missing_ok=True)


def test_lmcache_alone_never_unmaps_a_server_side_mapping(segment: Any) -> None:
    original = getattr(CpuShmTensorWrapper.to_tensor, "__wrapped__",
                       CpuShmTensorWrapper.to_tensor)
    before = mappings_of(segment.shm_name)
    tensor = original(segment)
    assert mappings_of(segment.shm_name) == before + 1
    del tensor
    gc.collect()
    assert mappings_of(segment.shm_name) == before + 1  # the leak the feature removes


def test_with_the_pin_dropped_the_last_view_unmaps(segment: Any) -> None:
    original = getattr(CpuShmTensorWrapper.to_tensor, "__wrapped__",
                       CpuShmTensorWrapper.to_tensor)
    to_tensor = engine_release._unpinning(original)
    before = mappings_of(segment.shm_name)
    tensor = to_tensor(segment)
    view = tensor.view(256, -1)[3]  # a view outlives the tensor it came from
    view.fill_(7)
    del tensor
    gc.collect()
    assert mappings_of(segment.shm_name) == before + 1
    assert int(view.sum()) == 7 * view.numel()  # still mapped, still readable
    del view
    gc.collect()
    assert mappings_of(segment.shm_name) == before


class FakeTransferModule:
    """LMCache's transfer module as :func:`engine_release.release_gone` uses it."""

    def __init__(self, ids: list[int]) -> None:
        self._lock = threading.Lock()
        self._cache_contexts = dict.fromkeys(ids)
        self.unregistered: list[int] = []

    def unregister_kv_cache(self, instance_id: int) -> None:
        self._cache_contexts.pop(instance_id)
        self.unregistered.append(instance_id)


class Named:
    def __init__(self, shm_name: str) -> None:
        self.shm_name = shm_name


def test_an_engine_whose_process_is_gone_is_unregistered() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = engine_release.EngineWatch()
        watch.registered(11, [Named(f"/lmcache_kv_{child.pid}_0"),
                              Named(f"/lmcache_kv_{child.pid}_0")])
        module = FakeTransferModule([11, 12])
        assert engine_release.release_gone(module, watch) == []  # alive: kept
        child.kill()
        child.wait()
        assert engine_release.release_gone(module, watch) == [11]
        assert module.unregistered == [11] and list(module._cache_contexts) == [12]
        assert engine_release.release_gone(module, watch) == []  # once
    finally:
        child.kill()
        child.wait()


def test_an_engine_that_cannot_be_watched_is_left_to_lmcache() -> None:
    watch = engine_release.EngineWatch()
    # a pid not visible here (another pid namespace, or above pid_max), a name without a pid,
    # and segments of two processes: none is judged
    watch.registered(1, [Named("/lmcache_kv_4194399_0")])
    watch.registered(2, [Named("/not_lmcache_0")])
    watch.registered(3, [Named(f"/lmcache_kv_{__import__('os').getpid()}_0"),
                         Named("/lmcache_kv_1_0")])
    module = FakeTransferModule([1, 2, 3])
    assert engine_release.release_gone(module, watch) == []
    assert module.unregistered == []
