"""The LMCache adapter in-process (the server path is in test_adapter_server.py): a load task
reads its files in parallel and sets a key's bit only for a verified file."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig, to_object_key
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.corruption import corrupt_file
from kvpersist.testing.helpers import key_of, wait_until
from kvpersist.testing.helpers import wait_for_task as wait_for

CHUNK = 64 * 1024


@dataclass
class Chunk:
    """What the adapter reads of LMCache's ``MemoryObj``: its ``byte_array``."""

    byte_array: bytearray


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(CHUNK))




@pytest.fixture
def adapter(tmp_path: Path) -> Any:
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path), 1.0, file_threads=8))
    assert a.store.wait_scan(10)
    yield a
    a.close()


def test_load_task_reads_in_parallel_and_verifies_each_file(adapter: Any,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    store: KvFileStore = adapter.store
    keys = [key_of(i) for i in range(12)]
    for i, k in enumerate(keys):
        assert store.put(k, payload(i)) == "stored"
    corrupt_file(store.path_for(keys[3]), "flip")
    corrupt_file(store.path_for(keys[7]), "half")
    store.path_for(keys[9]).unlink()
    in_flight, most = 0, 0
    lock = threading.Lock()
    real_read = store.read_into

    def counting_read(key: Any, buf: Any, lease: Any = None) -> bool:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.05)  # hold the slot so that concurrent reads overlap
        try:
            return real_read(key, buf, lease)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(store, "read_into", counting_read)
    chunks = [Chunk(bytearray(CHUNK)) for _ in keys]
    tid = adapter.submit_load_task([to_object_key(k) for k in keys], chunks)
    bitmap = wait_for(adapter.get_load_event_fd(), adapter.query_load_result, tid)
    hits = [i for i in range(len(keys)) if bitmap.test(i)]
    assert hits == [i for i in range(12) if i not in (3, 7, 9)]
    for i in hits:
        assert bytes(chunks[i].byte_array) == payload(i)
    assert most > 1, "the task's files were read one after another"
    status = adapter.report_status()
    assert status["verify_failures_by_reason"] == {"payload-checksum": 1, "size-mismatch": 1}
    assert status["read_bytes"] >= 9 * CHUNK and status["loaded_bytes"] == 9 * CHUNK
    monkeypatch.undo()
    assert store.check(deep=True) == []


def test_store_task_writes_every_file(adapter: Any) -> None:
    keys = [key_of(100 + i) for i in range(10)]
    tid = adapter.submit_store_task([to_object_key(k) for k in keys],
                                    [Chunk(bytearray(payload(i))) for i in range(10)])
    results = wait_for(adapter.get_store_event_fd(), lambda t: adapter.pop_completed_store_tasks()
                       .get(t), tid)
    assert results == 10 * CHUNK and len(adapter.store) == 10  # success: the bytes written
    assert adapter.store.check(deep=True) == []


def test_a_restore_leaves_its_steps_on_the_shared_clock_in_the_status(adapter: Any) -> None:
    """A lookup, then a load, mark every step of :data:`~kvpersist.l2.restore_timeline.STEPS`
    in order, between the caller's own ``time.monotonic()`` before and after (the clock a
    client in another process subtracts its send time from)."""
    from kvpersist.l2.restore_timeline import STEPS

    keys = [key_of(200 + i) for i in range(4)]
    for i, k in enumerate(keys):
        assert adapter.store.put(k, payload(i)) == "stored"
    assert adapter.report_status()["last_restore_timeline"] == {}
    began = time.monotonic()
    objects = [to_object_key(k) for k in keys]
    tid = adapter.submit_lookup_and_lock_task(objects, {})
    found = wait_for(adapter.get_lookup_and_lock_event_fd(),
                     adapter.query_lookup_and_lock_result, tid)
    assert [found.test(i) for i in range(4)] == [True] * 4
    tid = adapter.submit_load_task(objects, [Chunk(bytearray(CHUNK)) for _ in keys])
    wait_for(adapter.get_load_event_fd(), adapter.query_load_result, tid)
    ended = time.monotonic()
    timeline = adapter.report_status()["last_restore_timeline"]
    assert list(timeline) == list(STEPS), timeline
    stamps = [began, *timeline.values(), ended]
    assert stamps == sorted(stamps), timeline


def test_lmcache_loads_the_adapter_by_its_plugin_path(tmp_path: Path) -> None:
    """The plugin path the adapter templates name (``kvpersist.l2.adapter``): LMCache's plugin
    loader finds the adapter there."""
    module_path = "kvpersist.l2.adapter"
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import (
        PluginL2AdapterConfig,
        _create_plugin_adapter,
    )

    config = PluginL2AdapterConfig.from_dict({
        "module_path": module_path, "class_name": "KvPersistL2Adapter",
        "config_class_name": "KvPersistL2AdapterConfig",
        "adapter_params": {"path": str(tmp_path), "max_capacity_gb": 1}})
    adapter = _create_plugin_adapter(config)
    try:
        assert type(adapter) is KvPersistL2Adapter
        assert adapter.report_status()["root"] == str(tmp_path)
    finally:
        adapter.close()


def test_a_failed_scan_reports_the_adapter_unhealthy_until_it_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpersist.l2 import scanner as scanner_module

    real, calls = scanner_module.scan_root, []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("walker"))
        if len(calls) == 1:
            raise PermissionError(13, "Permission denied", str(tmp_path))
        return real(*args, **kwargs)

    monkeypatch.setattr(scanner_module, "scan_root", failing_once)
    monkeypatch.setattr(scanner_module, "SCAN_RETRY_S", 0.3)
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig.from_dict(
        {"path": str(tmp_path), "max_capacity_gb": 1, "walker": "python"}))
    try:
        deadline = time.monotonic() + 10
        while a.report_status()["is_healthy"]:
            assert time.monotonic() < deadline, "a failed scan left the adapter healthy"
            time.sleep(0.01)
        status = a.report_status()
        assert "Permission denied" in status["unhealthy_reason"]
        assert "stores are refused" in status["unhealthy_reason"]
        assert a.store.wait_scan(10)
        assert a.report_status()["is_healthy"] and "unhealthy_reason" not in a.report_status()
        assert calls == ["python", "python"]  # the configured walker, not the environment's
    finally:
        a.close()


def test_the_walker_is_a_strict_adapter_field() -> None:
    with pytest.raises(ValueError, match="walker"):
        KvPersistL2AdapterConfig.from_dict({"path": "/x", "max_capacity_gb": 1,
                                            "walker": "rust"})
    with pytest.raises(ValueError, match="walk_threads"):
        KvPersistL2AdapterConfig.from_dict({"path": "/x", "max_capacity_gb": 1,
                                            "walk_threads": -2})
    assert "walker (str)" in KvPersistL2AdapterConfig.help()


class Recorder:
    """An LMCache L2 listener that records what it is told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[Any]]] = []

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.events.append(("stored", list(keys)))

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        self.events.append(("accessed", list(keys)))

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        self.events.append(("deleted", list(keys)))


def test_stores_resume_before_lmcache_is_told_of_every_scanned_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart re-announces every file to LMCache (seconds for a million keys): stores resume
    as soon as the index is complete, LMCache hears of everything afterwards, in order (the
    scanned files oldest access first, then the new store, then a read), and its usage then
    equals the index's bytes."""
    old = [key_of(i) for i in range(20)]
    seed = KvFileStore(tmp_path, 1 << 30)
    seed.open(background_scan=False)
    for i, k in enumerate(old):
        assert seed.put(k, payload(i)) == "stored"
        time.sleep(0.002)  # distinct access times: the scan's order is the order written
    seed.close()

    release = threading.Event()
    real = KvPersistL2Adapter._notify_keys_stored
    held: list[int] = []

    def hold_the_first(self: Any, keys: list[Any], sizes: list[int]) -> None:
        held.append(len(keys))
        if len(held) == 1:  # the scan's announcement: LMCache is slow to take it
            assert release.wait(30)
        real(self, keys, sizes)

    monkeypatch.setattr(KvPersistL2Adapter, "_notify_keys_stored", hold_the_first)
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path), 1.0))
    recorder = Recorder()
    a.register_listener(recorder)
    try:
        assert a.store.wait_scan(10), "stores wait for LMCache to hear of the scanned files"
        # the announcer thread hands the scan to LMCache after the index completes: wait until
        # it is inside the held call (a CI run asserted before it got there)
        wait_until(lambda: held, timeout=10, interval=0.01,
                   message="the scan's announcement never reached LMCache")
        assert held == [len(old)] and a.get_usage().total_bytes_used == 0
        assert a.report_status()["announcements_pending"] >= 1
        new = key_of(100)
        tid = a.submit_store_task([to_object_key(new)], [Chunk(bytearray(payload(100)))])
        written = wait_for(a.get_store_event_fd(),
                           lambda t: a.pop_completed_store_tasks().get(t), tid)
        assert written == CHUNK and a.store.indexed(new)  # stored while LMCache lagged
        chunk = Chunk(bytearray(CHUNK))
        tid = a.submit_load_task([to_object_key(old[0])], [chunk])
        assert wait_for(a.get_load_event_fd(), a.query_load_result, tid).test(0)

        release.set()
        assert a.wait_announced(10)
        assert a.get_usage().total_bytes_used == a.store.used_bytes > 0
        assert a.report_status()["announcements_pending"] == 0
        assert recorder.events == [("stored", [to_object_key(k) for k in old]),
                                   ("stored", [to_object_key(new)]),
                                   ("accessed", [to_object_key(old[0])])]
    finally:
        release.set()
        a.close()


def test_an_eviction_returns_once_lmcache_heard_of_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's eviction checks its usage again a second after deleting: ``delete`` returns
    only when the deletions (and the restart's announcement queued before them) are
    delivered, so that check never counts the evicted bytes and evicts again."""
    keys = [key_of(i) for i in range(4)]
    seed = KvFileStore(tmp_path, 1 << 30)
    seed.open(background_scan=False)
    for i, k in enumerate(keys):
        assert seed.put(k, payload(i)) == "stored"
    seed.close()
    release = threading.Event()
    real = KvPersistL2Adapter._notify_keys_stored

    def slow_lmcache(self: Any, keys: list[Any], sizes: list[int]) -> None:
        assert release.wait(30)
        real(self, keys, sizes)

    monkeypatch.setattr(KvPersistL2Adapter, "_notify_keys_stored", slow_lmcache)
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(str(tmp_path), 1.0))
    try:
        assert a.store.wait_scan(10)
        evicting = threading.Thread(target=a.delete, args=([to_object_key(keys[0])],))
        evicting.start()
        evicting.join(0.5)
        assert evicting.is_alive(), "the eviction returned before LMCache heard of it"
        assert not a.store.indexed(keys[0])  # the file itself is gone already
        release.set()
        evicting.join(10)
        assert not evicting.is_alive()
        assert a.get_usage().total_bytes_used == a.store.used_bytes == 3 * a.store.indexed_sizes()[keys[1]]
    finally:
        release.set()
        a.close()


def test_a_hung_root_holds_only_its_own_file_threads(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads stuck on one root (a device that stopped answering) take that root's file
    threads and their task; loads and stores on the other root, and further tasks, go on.
    One shared pool, or a task thread waiting for its files, would stall them all."""
    from kvpersist.l2.placement import place

    roots = [tmp_path / "dev0", tmp_path / "dev1"]
    for r in roots:
        r.mkdir()
    a = KvPersistL2Adapter(KvPersistL2AdapterConfig(
        str(roots[0]), 1.0, io_threads=2, file_threads=2, extra_paths=(str(roots[1]),)))
    release, stuck = threading.Event(), threading.Semaphore(0)
    try:
        assert a.store.wait_scan(10)
        keys = [key_of(300 + i) for i in range(24)]
        for i, k in enumerate(keys):
            assert a.store.put(k, payload(i)) == "stored"
        names = [str(r) for r in roots]
        on = {r: [i for i, k in enumerate(keys) if place(k, names) == r] for r in (0, 1)}
        assert len(on[0]) >= 3 and len(on[1]) >= 4
        hung = {keys[i] for i in on[1]}
        real_read = KvFileStore.read_into

        def read_into(self: KvFileStore, key: Any, buf: Any, lease: Any = None) -> bool:
            if key in hung and not release.is_set():
                stuck.release()
                release.wait(60)
            return real_read(self, key, buf, lease)

        monkeypatch.setattr(KvFileStore, "read_into", read_into)
        hung_chunks = [Chunk(bytearray(CHUNK)) for _ in on[1]]
        hung_tid = a.submit_load_task([to_object_key(keys[i]) for i in on[1]], hung_chunks)
        for _ in range(2):  # both of root 1's file threads are stuck
            assert stuck.acquire(timeout=10)
        more_tid = a.submit_load_task([to_object_key(keys[on[1][0]])], [Chunk(bytearray(CHUNK))])
        for _ in range(2):  # task threads, as many as there are, each start a task
            chunks = [Chunk(bytearray(CHUNK)) for _ in on[0]]
            tid = a.submit_load_task([to_object_key(keys[i]) for i in on[0]], chunks)
            bitmap = wait_for(a.get_load_event_fd(), a.query_load_result, tid, timeout=10)
            assert [j for j in range(len(on[0])) if bitmap.test(j)] == list(range(len(on[0])))
            assert all(bytes(c.byte_array) == payload(i) for c, i in zip(chunks, on[0],
                                                                          strict=True))
        fresh = [k for k in (key_of(400 + i) for i in range(40)) if place(k, names) == 0][:3]
        tid = a.submit_store_task([to_object_key(k) for k in fresh],
                                  [Chunk(bytearray(payload(i))) for i in range(len(fresh))])
        assert wait_for(a.get_store_event_fd(), lambda t: a.pop_completed_store_tasks().get(t),
                        tid, timeout=10) == len(fresh) * CHUNK
        assert a.query_load_result(hung_tid) is None  # its files are still out
        release.set()
        bitmap = wait_for(a.get_load_event_fd(), a.query_load_result, hung_tid)
        assert all(bitmap.test(j) for j in range(len(on[1])))
        assert all(bytes(c.byte_array) == payload(i) for c, i in zip(hung_chunks, on[1],
                                                                      strict=True))
        assert wait_for(a.get_load_event_fd(), a.query_load_result, more_tid).test(0)
        monkeypatch.undo()
        assert a.store.check() == []
    finally:
        release.set()
        a.close()
