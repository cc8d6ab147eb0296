"""A lost drive costs only its own chunks, on real block devices: two ext4 file systems on loop
devices as two roots of kvpersist's LMCache adapter; one is remounted read-only, fails every
I/O with EIO (an ext4 shutdown) or leaves its mount point mid-run.  The other root's chunks
serve throughout, LMCache's accounting drops exactly the lost root's bytes, the status names
the degraded root, and the root serves again after it comes back and is scanned."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig
from kvpersist.l2.placement import place
from kvpersist.testing.helpers import key_of, wait_until
from kvpersist.testing.loop_device import LoopFilesystem, loop_filesystem, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
PAYLOAD = 256 * 1024


def payload(i: int) -> bytes:
    return bytes([i % 251]) * PAYLOAD


@pytest.fixture
def two_devices(tmp_path: Path) -> Iterator[tuple[LoopFilesystem, LoopFilesystem]]:
    with contextlib.ExitStack() as stack:
        yield (stack.enter_context(loop_filesystem(tmp_path / "d0", size_mb=32)),
               stack.enter_context(loop_filesystem(tmp_path / "d1", size_mb=32)))


def _fault_read_only(dev: LoopFilesystem) -> Callable[[], None]:
    dev.remount(read_only=True)
    return lambda: dev.remount(read_only=False)


def _fault_eio(dev: LoopFilesystem) -> Callable[[], None]:
    dev.fail_every_io()
    return dev.mount_again


def _fault_gone(dev: LoopFilesystem) -> Callable[[], None]:
    dev.unmount()
    return dev.mount_again


@pytest.mark.parametrize("fault, words", [
    (_fault_read_only, "read-only"),
    (_fault_eio, "Input/output error"),
    (_fault_gone, "not a directory any more"),
])
def test_a_failed_device_costs_only_its_chunks_and_serves_again_when_back(
        two_devices: tuple[LoopFilesystem, LoopFilesystem],
        fault: Callable[[LoopFilesystem], Callable[[], None]], words: str) -> None:
    roots = [dev.mount / "kv" for dev in two_devices]
    names = [str(r) for r in roots]
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig.from_dict(
        {"path": names[0], "extra_paths": [names[1]], "max_capacity_gb": 0.05}))
    a.store.probe_interval_s = 0.2
    try:
        assert a.store.wait_scan(10)
        keys = [key_of(i) for i in range(24)]
        for i, key in enumerate(keys):
            assert a.store.put(key, payload(i)) == "stored"
        lost = {k for k in keys if place(k, names) == 1}
        kept = [k for k in keys if k not in lost]
        assert lost and kept
        assert a.wait_announced(10)
        kept_bytes = sum(size for k, size in a.store.indexed_sizes().items() if k in kept)

        back = fault(two_devices[1])
        wait_until(lambda: a.store.degraded, timeout=20,
                   message="the failed device was never given up")
        (path, reason), = a.store.degraded
        assert path == roots[1] and words in reason, reason
        assert a.wait_announced(10)
        assert a.get_usage().total_bytes_used == a.store.used_bytes == kept_bytes
        buf = bytearray(PAYLOAD)
        for i, key in enumerate(keys):
            hit = a.store.read_into(key, buf)
            assert hit == (key in kept), key
            assert not hit or bytes(buf) == payload(i)
        status: dict[str, Any] = a.report_status()
        assert status["is_healthy"]  # the other device serves
        assert status["degraded_roots"] == [{"root": names[1], "reason": reason}]
        assert a.store.check() == []  # the serving root is exact

        back()
        wait_until(lambda: not a.store.degraded and a.store.scan_done, timeout=20,
                   message="the device never served again")
        assert a.wait_announced(10)
        for i, key in enumerate(keys):
            assert a.store.read_into(key, buf) and bytes(buf) == payload(i), key
        assert a.get_usage().total_bytes_used == a.store.used_bytes
        assert set(a.store.indexed_sizes()) == set(keys)
        assert a.store.check(deep=True) == []
    finally:
        a.close()
