"""A task touches LMCache's L1 buffers only within its lease (kvpersist.l2.lease): LMCache's
locks on them are TTL locks, and once one lapses the memory may hold another chunk.  A store
whose payload was not read in full within the lease publishes nothing (it would be another
chunk's bytes under its key, verified: a wrong hit after a restart); a load past its lease
reads nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2 import files as files_module
from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig, to_object_key
from kvpersist.l2.lease import Lease, LeaseExpired
from kvpersist.testing.helpers import key_of, wait_for_task

CHUNK = 64 * 1024


@dataclass
class Chunk:
    byte_array: bytearray


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def adapter(tmp_path: Path) -> Any:
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path / "root"), 1.0))
    assert a.store.wait_scan(10)
    yield a
    a.close()


def test_a_lease_ends_at_its_time() -> None:
    clock = ManualClock()
    lease = Lease.starting_now(270.0, clock)
    lease.check()
    clock.now += 269.9
    assert not lease.expired()
    clock.now += 0.1
    assert lease.expired()
    with pytest.raises(LeaseExpired, match="ended"):
        lease.check()


def test_a_store_whose_lease_ends_while_its_payload_is_written_publishes_nothing(
        adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease ends between the payload's hash and the rename (the write took too long): no
    file, no temp file, no bytes counted, the key a miss; another key stores as ever."""
    clock = ManualClock()
    real_digest = files_module.payload_digest

    def slow_digest(payload: memoryview) -> Any:
        clock.now += 300.0  # the write outlives LMCache's 300 s read lock
        return real_digest(payload)

    monkeypatch.setattr(files_module, "payload_digest", slow_digest)
    store = adapter.store
    key = key_of(1)
    assert store.put(key, bytes(CHUNK), None, Lease.starting_now(270.0, clock)) == "lease-expired"
    root = Path(adapter._config.path)
    assert not list(root.glob("*.kvp")) and not [p for p in root.iterdir() if ".tmp" in p.name]
    assert not store.contains_many([key])[0]
    monkeypatch.setattr(files_module, "payload_digest", real_digest)
    assert store.put(key_of(2), bytes(CHUNK), None, Lease.starting_now(270.0, clock)) == "stored"
    status = adapter.report_status()
    assert status["store_lease_expired"] == 1 and status["stores"] == 1


def test_a_store_task_past_its_lease_reads_nothing_and_reports_failure(
        tmp_path: Path) -> None:
    """Submitted with a lease already over (as when the task waited in the queue beyond
    LMCache's lock): the object's bytes are not read, no file appears, the result is a
    failure LMCache counts."""
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path / "root"), 1.0,
                                                    store_lease_s=1e-9))
    try:
        assert a.store.wait_scan(10)
        time.sleep(0.01)
        tid = a.submit_store_task([to_object_key(key_of(5))], [Chunk(bytearray(CHUNK))])
        result = wait_for_task(a.get_store_event_fd(),
                               lambda t: a.pop_completed_store_tasks().get(t), tid)
        assert not result.is_successful()
        assert not list((tmp_path / "root").glob("*.kvp"))
        assert a.report_status()["store_lease_expired"] == 1
    finally:
        a.close()


def test_a_load_past_its_lease_leaves_the_buffer_alone(tmp_path: Path) -> None:
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path / "root"), 1.0,
                                                    load_lease_s=1e-9))
    try:
        assert a.store.wait_scan(10)
        key = key_of(7)
        assert a.store.put(key, b"\x5a" * CHUNK) == "stored"
        buf = Chunk(bytearray(b"\x11" * CHUNK))
        time.sleep(0.01)
        tid = a.submit_load_task([to_object_key(key)], [buf])
        bitmap = wait_for_task(a.get_load_event_fd(), a.query_load_result, tid)
        assert not bitmap.test(0)
        assert bytes(buf.byte_array) == b"\x11" * CHUNK  # not a byte written
        assert a.report_status()["load_lease_expired"] == 1
    finally:
        a.close()


def test_the_leases_are_adapter_settings_checked_like_the_others() -> None:
    config = KvPersistL2AdapterConfig.from_dict(
        {"path": "/x", "max_capacity_gb": 1, "store_lease_s": 100, "load_lease_s": 200})
    assert (config.store_lease_s, config.load_lease_s) == (100, 200)
    defaults = KvPersistL2AdapterConfig.from_dict({"path": "/x", "max_capacity_gb": 1})
    assert (defaults.store_lease_s, defaults.load_lease_s) == (270.0, 540.0)
    with pytest.raises(ValueError, match="store_lease_s"):
        KvPersistL2AdapterConfig.from_dict({"path": "/x", "max_capacity_gb": 1,
                                            "store_lease_s": 0})
    assert "load_lease_s" in KvPersistL2AdapterConfig.help()
