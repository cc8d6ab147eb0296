"""Several drives behind a real LMCache MP server (``kvp-server`` with ``KVP_CACHE_EXTRA_ROOTS``
on two loop-device file systems), driven by LMCache's own bench client: chunks spread over
both devices; one device fails every I/O mid-run (an ext4 shutdown); the other device's chunks
come back bit-identical while the failed one's miss, ``/status`` and ``/metrics`` name the
degraded root, and once the device is mounted again every chunk comes back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.admin.cli.server_cmd import degraded_roots
from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving import http
from kvpersist.serving.launcher.vllm_client import metric_sum
from kvpersist.serving.lmcache_compat import status as server_status
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import (
    adapter_status,
    clear_l1,
    l2_files,
    server_env,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.loop_device import LoopFilesystem, loop_filesystem, unavailable

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
MODEL = "org/model/kvp-" + "c" * 32
SEQUENCES = 10  # one 256-token chunk each


@pytest.fixture
def two_devices(tmp_path: Path) -> Iterator[tuple[LoopFilesystem, LoopFilesystem]]:
    with contextlib.ExitStack() as stack:
        yield (stack.enter_context(loop_filesystem(tmp_path / "d0", size_mb=24)),
               stack.enter_context(loop_filesystem(tmp_path / "d1", size_mb=24)))


def _all_files(roots: list[Path]) -> list[set[str]]:
    return [set(l2_files(r)) if r.is_dir() else set() for r in roots]


def test_a_failed_drive_behind_the_server_costs_only_its_chunks(
        two_devices: tuple[LoopFilesystem, LoopFilesystem]) -> None:
    roots = [dev.mount / "kv" for dev in two_devices]
    settings: ServerSettings = load_settings(server_env(
        roots[0], KVP_CACHE_EXTRA_ROOTS=str(roots[1]), KVP_CACHE_BUDGET_GB="0.04",
        KVP_RUNTIME_DIR=str(two_devices[0].mount.parent / "run")))
    start_server(settings)
    driver = BenchDriver(settings.request_url, settings.http_url, MODEL, num_tokens=256)
    try:
        where: dict[int, int] = {}  # sequence -> the root its one chunk landed on
        sums: dict[int, list[str]] = {}
        for seq in range(SEQUENCES):
            before = _all_files(roots)
            sums[seq] = driver.checksums(seq)
            assert driver.store(seq)
            wait_until(lambda b=before: sum(map(len, _all_files(roots))) == sum(map(len, b)) + 1,
                       timeout=30, interval=0.1, message=f"sequence {seq} never reached L2")
            after = _all_files(roots)
            where[seq] = next(i for i in range(2) if after[i] - before[i])
        assert set(where.values()) == {0, 1}, f"every chunk on one root: {where}"
        kept_bytes = sum(f.stat().st_size for f in roots[0].glob("*.kvp"))

        two_devices[1].fail_every_io()
        wait_until(lambda: adapter_status(settings).get("degraded_roots"), timeout=30,
                   message="the server never gave the failed drive up")
        status = adapter_status(settings)
        assert status["is_healthy"]
        (degraded,) = status["degraded_roots"]
        assert degraded["root"] == str(roots[1]) and "Input/output error" in degraded["reason"]
        assert status["used_bytes"] == kept_bytes
        # kvp-admin status names it too (its table reads the server's /status)
        assert [d["root"] for d in degraded_roots(server_status.fetch(settings.http_url) or {})
                ] == [str(roots[1])]
        metrics = http.get(settings.http_url + "/metrics", timeout=10).body.decode()
        assert metric_sum(metrics, "kvpersist_l2_root_degraded", root=str(roots[1])) == 1
        assert metric_sum(metrics, "kvpersist_l2_root_degraded", root=str(roots[0])) == 0
        clear_l1(settings)
        for seq in range(SEQUENCES):
            trip = driver.lookup_and_retrieve(seq, sums[seq])
            if where[seq] == 0:
                assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == \
                    (1, True, True), seq
            else:
                assert trip.hit_chunks == 0, seq

        two_devices[1].mount_again()
        wait_until(lambda: not adapter_status(settings).get("degraded_roots")
                   and adapter_status(settings)["scan_done"], timeout=30,
                   message="the drive never served again")
        clear_l1(settings)
        for seq in range(SEQUENCES):
            trip = driver.lookup_and_retrieve(seq, sums[seq])
            assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == \
                (1, True, True), seq
        assert adapter_status(settings)["files"] == SEQUENCES
    finally:
        driver.close()
        stop_server(settings)
