"""kvpersist's L2 adapter inside a real LMCache MP server, driven by LMCache's own bench client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import free_port
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import QUARANTINE_DIR, format_name, parse_name
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import (
    ServerError,
    server_command,
    server_environment,
    start_server,
    stop_server,
)
from kvpersist.testing.corruption import corrupt_file
from kvpersist.testing.helpers import (
    adapter_status,
    clear_l1,
    kvpersist_settings,
    l2_files,
    l2_store_answers,
    server_env,
    wait_for_l2_files,
    wait_for_l2_idle,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.processes import kill_server

pytestmark = pytest.mark.integration
MODEL_A = "org/model/kvp-" + "a" * 32
MODEL_B = "org/model/kvp-" + "b" * 32
CHUNK_FILE = HEADER_SIZE + 256 * 1024  # one 256-token chunk of the bench shape


def driver(s: ServerSettings, model: str = MODEL_A) -> BenchDriver:
    return BenchDriver(s.request_url, s.http_url, model)


def store_and_wait(d: BenchDriver, root: Path, seq: int) -> list[str]:
    sums = d.checksums(seq)
    before = len(l2_files(root))
    assert d.store(seq)
    wait_for_l2_files(root, before + len(sums))
    return sums


def test_bench_client_round_trip_through_l2_after_restart(settings: ServerSettings) -> None:
    start_server(settings)
    d = driver(settings)
    sums = store_and_wait(d, settings.cache_root, 1)
    files = l2_files(settings.cache_root, (".kvp",))
    assert len(files) == len(sums) == 4
    assert all(n.startswith("org--model--kvp-" + "a" * 32 + "_") for n in files)
    assert all((settings.cache_root / n).stat().st_size == CHUNK_FILE for n in files)
    d.close()
    stop_server(settings)  # SIGTERM: the adapter closes and leaves its index snapshot
    start_server(settings)
    d = driver(settings)
    trip = d.lookup_and_retrieve(1, sums)
    assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (4, True, True)
    status = adapter_status(settings)
    assert status["load_hits"] == 4 and status["verify_failures"] == 0
    assert status["scan_source"] == "snapshot"  # a clean restart walks no directory
    assert status["used_bytes"] == 4 * CHUNK_FILE
    # LMCache's own listing API works through list_l2_keys.
    body = http.get(settings.http_url + "/cache/objects", timeout=10).body
    listed = json.loads(body)["entries"]
    assert {e["key"]["chunk_hash_hex"] for e in listed} == {parse_name(n).chunk_hash.hex()
                                                            for n in files}
    d.close()


def test_data_survives_sigkill(settings: ServerSettings) -> None:
    start_server(settings)
    d = driver(settings)
    sums = store_and_wait(d, settings.cache_root, 2)
    d.close()
    kill_server(settings)  # SIGKILL; returns once the server has exited
    start_server(settings)  # detects and replaces the stale pid file
    d = driver(settings)
    trip = d.lookup_and_retrieve(2, sums)
    assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (4, True, True)
    status = adapter_status(settings)
    assert status["scan_source"] == "disk"  # a killed server left no snapshot
    assert status["used_bytes"] == sum(p.stat().st_size for p in settings.cache_root.glob("*.kvp"))
    d.close()


def donor_for(victim: Path, how: str, root: Path, originals: dict[Path, bytes]) -> bytes | None:
    """What the donor kinds put in ``victim``'s place: the next chunk's valid file
    (``other-key``) or the same chunk of namespace B (``other-namespace``)."""
    if how == "other-key":
        names = sorted(originals)
        return originals[names[(names.index(victim) + 1) % len(names)]]
    if how == "other-namespace":
        key = parse_name(victim.name)
        return (root / format_name(key._replace(model_name=MODEL_B))).read_bytes()
    return None


@pytest.mark.parametrize("how", ["noise", "random", "half", "zero", "header", "other-key",
                                 "other-namespace"])
def test_corruption_is_a_miss_then_repaired(settings: ServerSettings, how: str) -> None:
    root = settings.cache_root
    start_server(settings)
    if how == "other-namespace":
        # Same tokens, so the same chunk hashes, in another namespace.  LMCache's bench client
        # supports one live client per server at a time (they share an instance id).
        d_b = driver(settings, MODEL_B)
        store_and_wait(d_b, root, 3)
        d_b.close()
    d = driver(settings)
    sums = store_and_wait(d, root, 3)
    clear_l1(settings)
    victims = sorted(root.glob(f"org--model--kvp-{'a' * 32}_*.kvp"))
    assert len(victims) == 4
    originals = {v: v.read_bytes() for v in victims}
    for victim in victims:  # every chunk damaged: no retrieval can succeed
        corrupt_file(victim, how, donor_for(victim, how, root, originals))
    trip = d.lookup_and_retrieve(3, sums)
    assert trip.checksums_match, "wrong bytes were served"
    assert trip.hit_chunks == 0
    status = adapter_status(settings)
    assert status["verify_failures"] >= 1 and status["quarantined"] >= 1
    assert len(list((root / QUARANTINE_DIR).iterdir())) == status["quarantined"]
    # repair: the next store writes good files, and they load byte-identical
    assert d.store(3)
    wait_until(lambda: len(list(root.glob(f"org--model--kvp-{'a' * 32}_*.kvp"))) == 4)
    clear_l1(settings)
    trip = d.lookup_and_retrieve(3, sums)
    assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (4, True, True)
    d.close()


def disk_bytes(root: Path) -> int:
    """Bytes of the .kvp files now; a file evicted between the listing and its stat counts 0."""
    total = 0
    for path in root.glob("*.kvp"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def test_accounting_cap_and_eviction(tmp_path: Path) -> None:
    budget_files = 24
    budget_gb = budget_files * CHUNK_FILE / 1024**3
    s = kvpersist_settings(tmp_path / "cache", budget_gb=f"{budget_gb:.9f}")
    cap = int(float(f"{budget_gb:.9f}") * 1024**3)
    try:
        start_server(s)
        d = driver(s)
        for seq in range(4):  # 16 files: 2/3 of the budget, below the watermark
            store_and_wait(d, s.cache_root, 10 + seq)
        disk = sum(p.stat().st_size for p in s.cache_root.glob("*.kvp"))
        assert adapter_status(s)["used_bytes"] == disk == 16 * CHUNK_FILE
        d.close()
        stop_server(s)
        start_server(s)  # restart: the snapshot restores the count, header overhead included
        assert adapter_status(s)["used_bytes"] == disk
        assert adapter_status(s)["scan_source"] == "snapshot"
        d = driver(s)
        peak = 0
        answered = l2_store_answers(adapter_status(s))
        for seq in range(4, 12):  # far beyond the budget
            assert d.checksums(10 + seq)
            d.store(10 + seq)
            answered += 4
            # the peak on disk, sampled until the adapter has answered this sequence's stores
            deadline = time.monotonic() + 60
            while True:
                peak = max(peak, disk_bytes(s.cache_root))
                if l2_store_answers(adapter_status(s)) >= answered:
                    break
                assert time.monotonic() < deadline, f"stores of sequence {seq} not answered"
                time.sleep(0.05)
        # every store answered (8 sequences of 4 chunks), none in flight, eviction done
        wait_for_l2_idle(s, stores_at_least=8 * 4)
        disk = sum(p.stat().st_size for p in s.cache_root.glob("*.kvp"))
        status = adapter_status(s)
        assert peak <= cap, "the hard cap was exceeded on disk"
        assert status["used_bytes"] == disk
        assert disk <= 0.9 * cap + CHUNK_FILE  # LRU eviction at the 0.9 watermark
        assert status["evicted"] > 0
        d.close()
    finally:
        stop_server(s)


def test_second_server_on_same_root_is_refused(settings: ServerSettings, tmp_path: Path) -> None:
    start_server(settings)
    with pytest.raises(ServerError, match="already runs"):
        start_server(settings)
    # A second server started by other means (no pid file check) meets the adapter's root lock.
    other = load_settings({
        "KVP_CACHE_ROOT": str(settings.cache_root), "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": "1", "KVP_CACHE_BUDGET_GB": "1",
        "KVP_RUNTIME_DIR": str(tmp_path / "run2")})
    (tmp_path / "run2").mkdir(mode=0o700)
    log = tmp_path / "second.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(server_command(other), env=server_environment(), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the second server kept running:\n{log.read_text()[-2000:]}")
    assert proc.returncode != 0
    assert "one writer per root" in log.read_text()


def test_a_restore_the_server_moves_is_checked_against_zeroed_buffers(tmp_path: Path) -> None:
    """``lmcache_driven``: the server copies straight into the client's KV, and LMCache's bench
    client neither zeroes it before a retrieve nor differs from the client that stored (seeded
    data).  The driver zeroes it, so checksums match only when the retrieve moved the bytes."""
    s = load_settings(server_env(tmp_path / "cache", KVP_ACCESS="tcp",
                                 KVP_CACHE_BUDGET_GB="1"))
    start_server(s)
    try:
        d = BenchDriver(s.request_url, s.http_url, MODEL_A, transfer_mode="lmcache_driven")
        sums = store_and_wait(d, s.cache_root, 1)
        d.close()
        stop_server(s)
        start_server(s)
        d = BenchDriver(s.request_url, s.http_url, MODEL_A, transfer_mode="lmcache_driven")
        d.zero_request(1)
        assert d.checksums(1) != sums  # what a retrieve that moved nothing would be judged on
        trip = d.lookup_and_retrieve(1, sums)
        assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (4, True, True)
        assert adapter_status(s)["load_hits"] == 4
        d.close()
    finally:
        stop_server(s)
