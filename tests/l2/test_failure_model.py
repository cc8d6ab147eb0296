"""Failure-model rows with a real LMCache server and the kvpersist adapter (ARCHITECTURE §5):
crash during writes, disk full, interrupted eviction; and the server's security defaults."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.l2.files import verify_file
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.crash_cycles import run_cycles
from kvpersist.testing.helpers import adapter_status as adapter
from kvpersist.testing.helpers import (
    clear_l1,
    kvpersist_settings,
    tcp_listeners,
    wait_for_l2_idle,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.processes import kill_server, server_pid

pytestmark = pytest.mark.integration
MODEL = "org/model/kvp-" + "f" * 32
CHUNK_FILE = HEADER_SIZE + 256 * 1024


def test_kill_9_during_heavy_stores(settings: ServerSettings) -> None:
    report = run_cycles(settings, cycles=5)
    assert report.kills == 5 and report.cycles == 5
    assert report.wrong_reads == 0
    assert report.bad_files == []
    assert report.temp_left == 0
    assert report.accounting_mismatches == 0
    assert report.files_checked > 0 and report.retrieved_chunks > 0


def test_disk_full_rejects_stores_and_resumes(small_fs: Path) -> None:
    """A 3 MiB file system under a 1 GiB budget: ENOSPC is a rejected store, never a partial
    file; serving continues; once space is freed, stores resume."""
    s = kvpersist_settings(small_fs / "cache")
    try:
        start_server(s)
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        for seq in range(4):  # 16 chunks of 260 KiB ≫ 3 MiB
            d.store(seq)
        status = wait_for_l2_idle(s, stores_at_least=4 * 4)  # each one written or refused
        assert status["rejected_disk_full"] > 0
        assert not [p for p in s.cache_root.iterdir() if ".tmp." in p.name]
        for path in s.cache_root.glob("*.kvp"):
            assert verify_file(path)[0] is None, path
        assert status["used_bytes"] == sum(p.stat().st_size for p in s.cache_root.glob("*.kvp"))
        # serving continues: what is stored reads back byte-identical, from L2 (L1 emptied)
        clear_l1(s)
        loads_before = adapter(s)["load_hits"]
        sums = d.checksums(0)
        trip = d.lookup_and_retrieve(0, sums)
        assert trip.hit_chunks >= 1, "nothing of the first conversation came back from L2"
        assert trip.retrieved_ok and trip.checksums_match
        assert adapter(s)["load_hits"] - loads_before >= trip.hit_chunks  # read from the disk
        # free space: remove the log (it lives on the same small fs) and the stored objects
        clear_l1(s)
        listed = http.get(s.http_url + "/cache/objects", timeout=10).json()["entries"]
        resp = http.request("DELETE", s.http_url + "/cache/objects", timeout=10,
                            payload={"keys": [e["key"] for e in listed], "tier": "all"})
        assert resp.ok, resp
        stored_before = adapter(s)["stores"]
        d.store(9)
        wait_until(lambda: adapter(s)["stores"] > stored_before,
                   message="stores did not resume after freeing space")
        d.close()
    finally:
        stop_server(s)


def test_kill_during_eviction_restarts_clean(tmp_path: Path) -> None:
    budget_files = 12
    budget_gb = f"{budget_files * CHUNK_FILE / 1024**3:.9f}"
    s = kvpersist_settings(tmp_path / "cache", budget_gb)
    try:
        start_server(s)
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        sums = {seq: d.checksums(seq) for seq in range(6)}
        for seq in range(6):  # 24 chunks into a 12-chunk budget: eviction runs repeatedly
            d.store(seq)
            time.sleep(0.1)  # pacing: the stores spread over the eviction passes
        deadline = time.monotonic() + 30
        while adapter(s)["evicted"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval (the kill goes ahead after 30 s regardless)
        kill_server(s)  # SIGKILL while eviction is (or was just) deleting; waits for the exit
        start_server(s)
        wait_until(lambda: adapter(s)["scan_done"], interval=0.1,
                   message="the start-up scan did not finish")
        status = adapter(s)
        disk = sum(p.stat().st_size for p in s.cache_root.glob("*.kvp"))
        assert status["used_bytes"] == disk <= int(float(budget_gb) * 1024**3)
        assert not [p for p in s.cache_root.iterdir() if ".tmp." in p.name]
        d2 = BenchDriver(s.request_url, s.http_url, MODEL)
        hits = 0
        for seq, expected in sums.items():  # evicted files are ordinary misses, never wrong
            trip = d2.lookup_and_retrieve(seq, expected)  # a fresh server: L1 is empty
            assert trip.retrieved_ok and trip.checksums_match, seq
            hits += trip.hit_chunks
        d2.close()
        files = len(list(s.cache_root.glob("*.kvp")))
        assert 0 < hits <= files, (hits, files)  # what survived the kill came back from L2
        assert adapter(s)["load_hits"] >= hits
    finally:
        stop_server(s)


def test_security_defaults(settings: ServerSettings) -> None:
    start_server(settings)
    assert (settings.cache_root.stat().st_mode & 0o777) == 0o700
    assert (settings.socket_dir.stat().st_mode & 0o777) == 0o700
    pid = server_pid(settings)
    assert tcp_listeners(pid) == [], "the server listens on TCP by default"
    for method in ("GET", "POST"):
        code = http.request(method, settings.http_url + "/run_script", timeout=10,
                            payload={} if method == "POST" else None).status
        assert code in (403, 404, 405), f"/run_script answered {code} to {method}"
    env = Path(f"/proc/{pid}/environ")
    environ = dict(kv.split("=", 1) for kv in env.read_text().split("\0") if "=" in kv)
    assert environ["LMCACHE_TRACK_USAGE"] == "false" and environ["DO_NOT_TRACK"] == "1"
