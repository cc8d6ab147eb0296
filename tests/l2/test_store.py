"""The verified file store: format, atomic publish, corruption → miss + quarantine + repair,
exact accounting across restarts, the hard cap, one writer per root."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvpersist.l2 import inventory
from kvpersist.l2 import scanner as scanner_module
from kvpersist.l2.format import HEADER_SIZE, build_header, parse_header, payload_digest
from kvpersist.l2.layout import QUARANTINE_DIR, FormatError, KeyFields, format_name, parse_name
from kvpersist.l2.lock import take_root_lock
from kvpersist.l2.store import KvFileStore, RootLockedError
from kvpersist.testing.checked_stores import open_checked_store, track
from kvpersist.testing.corruption import EXPECTED_REASON, corrupt_file

NS_A = "kvp-" + "a" * 32
NS_B = "kvp-" + "b" * 32


def key(i: int, ns: str = NS_A, salt: str = "") -> KeyFields:
    return KeyFields(f"org/model/{ns}", 0x01000100, 0, i.to_bytes(32, "big"), salt)


def payload(i: int, size: int = 8192) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(size))


# Each test ends on ``KvFileStore.check()`` of the stores it opened (tests/l2/conftest.py).
open_store = open_checked_store


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize("salt", ["", "user-7"])
def test_name_round_trip(salt: str) -> None:
    k = key(5, salt=salt)
    name = format_name(k)
    assert name.startswith(f"org--model--{NS_A}_01000100_0_") and name.endswith(".kvp")
    assert parse_name(name) == k


@pytest.mark.parametrize("name", [
    "x.kvp", "a_b_c.kvp", "m_0100010_0_ab.kvp", "m_01000100_0_zz.kvp", "m_01000100_0_ab.bin",
    "m_01000100_0_ab.kvp.tmp.123", "m_01000100_0_ab@.kvp"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(FormatError):
        parse_name(name)


def test_header_round_trip_and_self_check() -> None:
    k = key(1)
    data = payload(1)
    raw = build_header(k, len(data), payload_digest(data), {"shape": [2, 3]})
    assert len(raw) == HEADER_SIZE
    header = parse_header(raw)
    assert header.key == k and header.payload_len == len(data)
    assert header.checksum == payload_digest(data) and header.layout == {"shape": [2, 3]}
    damaged = bytearray(raw)
    damaged[100] ^= 0x01
    with pytest.raises(FormatError) as info:
        parse_header(bytes(damaged))
    assert info.value.reason == "header-checksum"


# ----------------------------------------------------------------------------- store / load


def test_store_then_verified_load(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = payload(1)
    assert store.put(key(1), data) == "stored"
    assert store.put(key(1), data) == "exists"
    path = store.path_for(key(1))
    assert path.stat().st_size == HEADER_SIZE + len(data)
    assert store.used_bytes == HEADER_SIZE + len(data)
    buf = bytearray(len(data))
    assert store.read_into(key(1), buf) and bytes(buf) == data
    assert store.contains(key(1)) and not store.contains(key(2))
    assert not store.read_into(key(2), bytearray(len(data)))
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


@pytest.mark.parametrize(("how", "reason"), sorted(
    (how, reason) for how, reason in EXPECTED_REASON.items() if how != "other-namespace"))
def test_corruption_is_a_miss_quarantined_then_repaired(tmp_path: Path, how: str, reason: str) -> None:
    store = open_store(tmp_path)
    data = payload(1)
    store.put(key(1), data)
    store.put(key(2), payload(2))
    path = store.path_for(key(1))
    corrupt_file(path, how, store.path_for(key(2)) if how == "other-key" else None)
    buf = bytearray(len(data))
    assert not store.read_into(key(1), buf)
    assert store.stats.verify_failures[reason] == 1, dict(store.stats.verify_failures)
    assert not path.exists()
    assert len(list((tmp_path / QUARANTINE_DIR).iterdir())) == 1
    assert not store.contains(key(1))
    assert store.used_bytes == HEADER_SIZE + len(payload(2))
    # repair: the next store of the key writes a good file
    assert store.put(key(1), data) == "stored"
    assert store.read_into(key(1), buf) and bytes(buf) == data


def test_file_from_another_namespace_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put(key(1, NS_B), payload(1))
    # An operator copies namespace B's file under namespace A's name for the same chunk.
    store.path_for(key(1, NS_B)).rename(store.path_for(key(1, NS_A)))
    store.close()
    store = open_store(tmp_path)
    assert store.contains(key(1, NS_A))
    assert not store.read_into(key(1, NS_A), bytearray(8192))
    assert store.stats.verify_failures["key-mismatch"] == 1


def test_length_mismatch_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put(key(1), payload(1))
    assert not store.read_into(key(1), bytearray(4096))
    assert store.stats.verify_failures["length-mismatch"] == 1


# ----------------------------------------------------------------------------- restart, cap


def test_restart_restores_accounting_and_lru_order(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for i in range(10):
        store.put(key(i), payload(i, 4096 + i))
    for i in range(10):  # make the mtimes strictly increasing in reverse order
        os.utime(store.path_for(key(i)), (1000 - i, 1000 - i))
    (tmp_path / (format_name(key(99)) + ".tmp.deadbeef")).write_bytes(b"partial")
    (tmp_path / "README.txt").write_text("not a cache file")
    store.close()
    seen: list[KeyFields] = []
    store2 = KvFileStore(tmp_path, 10**9, on_added=lambda keys, sizes: seen.extend(keys))
    store2.open(background_scan=False)
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".kvp")
    assert store2.used_bytes == on_disk == sum(HEADER_SIZE + 4096 + i for i in range(10))
    assert seen == [key(i) for i in reversed(range(10))]  # oldest access first
    assert store2.stats.temp_removed == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]
    assert (tmp_path / "README.txt").exists()


def test_hard_cap_rejects_and_serving_continues(tmp_path: Path) -> None:
    size = HEADER_SIZE + 8192
    store = open_store(tmp_path, capacity=3 * size)
    for i in range(3):
        assert store.put(key(i), payload(i)) == "stored"
    assert store.put(key(3), payload(3)) == "rejected-capacity"
    assert store.status()["rejected_capacity"] == 1
    assert store.used_bytes == 3 * size
    assert store.read_into(key(0), bytearray(8192))
    store.delete(key(0))
    assert store.put(key(3), payload(3)) == "stored"


def test_concurrent_stores_never_exceed_cap(tmp_path: Path) -> None:
    size = HEADER_SIZE + 8192
    store = open_store(tmp_path, capacity=20 * size)
    results: list[str] = []

    def worker(start: int) -> None:
        for i in range(start, start + 20):
            results.append(store.put(key(i), payload(i)))

    threads = [threading.Thread(target=worker, args=(n * 100,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("stored") == 20
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".kvp")
    assert on_disk == store.used_bytes == 20 * size


def test_stores_wait_for_the_scan_but_lookups_do_not(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put(key(1), payload(1))
    store.close()
    store2 = KvFileStore(tmp_path, 10**9)
    track(store2)
    # open by hand without scanning, to observe the scanning state
    store2._lock_fd = take_root_lock(tmp_path)
    assert not store2.scan_done
    assert store2.check() == ["the start-up scan has not finished"]
    assert store2.contains(key(1))  # answered from disk while the scan has not run
    assert store2.put(key(2), payload(2)) == "rejected-scanning"
    store2.scanner.scan_once()
    assert store2.used_bytes == HEADER_SIZE + 8192  # the lookup's entry was not double counted
    assert store2.put(key(2), payload(2)) == "stored"
    assert store2.check() == []
    store2.close()


def test_one_writer_per_root(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(RootLockedError, match="one writer per root"):
        open_store(tmp_path)
    store.close()
    open_store(tmp_path).close()


def test_sharded_layout(tmp_path: Path) -> None:
    store = open_store(tmp_path, sharded=True)
    store.put(key(0x1234), payload(1))
    path = store.path_for(key(0x1234))
    assert path.parent.parent.parent == tmp_path and len(path.parent.name) == 2
    store.close()
    store = open_store(tmp_path, sharded=True)
    assert store.used_bytes == HEADER_SIZE + 8192
    assert store.read_into(key(0x1234), bytearray(8192))


def test_list_keys_pages(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for i in range(7):
        store.put(key(i, NS_A if i % 2 else NS_B), payload(i, 1024))
    page, nxt = store.list_keys(None, 0, 5)
    assert len(page) == 5 and nxt == 5
    rest, nxt2 = store.list_keys(None, 5, 5)
    assert len(rest) == 2 and nxt2 is None
    only_a, _ = store.list_keys(f"org/model/{NS_A}", 0, 100)
    assert {k for k, _ in only_a} == {key(i) for i in (1, 3, 5)}


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("with_c", [True, False])
def test_scan_takes_only_data_directories(tmp_path: Path, sharded: bool, with_c: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up scan indexes published .kvp files in the root (and, sharded, in root/xx/yy)
    only; it removes temp leftovers there and nowhere else; odd keys round-trip exactly, through
    the C walker and key parser and through their Python fallbacks."""
    if not with_c:
        monkeypatch.setattr(inventory, "_walk", None)
    root = tmp_path / "cache"
    store = open_store(root, sharded=sharded)
    odd = [KeyFields(f"org/m/{NS_A}", 0xFFFFFFFF, 2**70 + 5, b"\xab" * 32, "salt-1"),
           KeyFields(f"org/m/{NS_A}", 1, 0, b"", ""),
           KeyFields(f"org/m/{NS_A}", 2, 0x1F, bytes(range(16)), "")]
    for i, k in enumerate([*odd, key(7)]):
        assert store.put(k, payload(i, 512)) == "stored"
    store.close()
    want = {store.path_for(k).name for k in [*odd, key(7)]}
    foreign_dirs = [root / "notes", root / "ab", root / QUARANTINE_DIR]
    for d in foreign_dirs:
        d.mkdir(exist_ok=True)
    elsewhere = format_name(key(8))
    (root / "notes" / elsewhere).write_bytes(b"x" * 4096)  # not a data directory
    (root / "ab" / elsewhere).write_bytes(b"x" * 4096)  # one level only: not a shard
    (root / QUARANTINE_DIR / elsewhere).write_bytes(b"x" * 4096)
    (root / "notes" / (elsewhere + ".tmp.0001")).write_bytes(b"t")  # kept: not a data dir
    (root / (elsewhere + ".tmp.0002")).write_bytes(b"t")  # removed
    (root / (elsewhere[:-4] + ".bin")).write_bytes(b"n" * 4096)  # nixl's file: not ours
    (root / "broken.kvp").write_bytes(b"?")
    (root / format_name(key(9))).symlink_to(root / "notes" / elsewhere)
    seen: list[KeyFields] = []
    store2 = KvFileStore(root, 10**9, sharded=sharded,
                         on_added=lambda keys, sizes: seen.extend(keys))
    store2.open(background_scan=False)
    assert {store2.path_for(k).name for k in seen} == want
    assert set(seen) == {*odd, key(7)}
    assert store2.used_bytes == sum(store2.path_for(k).stat().st_size for k in seen)
    assert store2.stats.temp_removed == 1 and store2.stats.unparsable_names == 1
    assert (root / "notes" / (elsewhere + ".tmp.0001")).exists()
    assert not (root / (elsewhere + ".tmp.0002")).exists()
    buf = bytearray(512)
    assert store2.read_into(odd[0], buf) and bytes(buf) == payload(0, 512)
    assert store2.check() == [f"not a quarantined cache file: {root / QUARANTINE_DIR / elsewhere}"]
    (root / QUARANTINE_DIR / elsewhere).unlink()
    track(store2)


# ----------------------------------------------------------------------------- the oracle


def test_check_names_every_inconsistency(tmp_path: Path) -> None:
    """The oracle can fail: each way the disk and the index can disagree is reported."""
    store = KvFileStore(tmp_path, 10**9)
    store.open(background_scan=False)
    for i in range(5):
        assert store.put(key(i), payload(i)) == "stored"
    assert store.check(deep=True) == []
    store.path_for(key(0)).unlink()  # deleted behind the store's back
    with store.path_for(key(1)).open("ab") as fh:  # grew behind its back
        fh.write(b"x")
    store.path_for(key(2)).replace(tmp_path / QUARANTINE_DIR / (
        format_name(key(2)) + ".payload-checksum.1"))  # a good file in quarantine
    other = KvFileStore(tmp_path / "elsewhere", 10**9)
    other.open(background_scan=False)
    other.put(key(7), payload(7))
    other.close()
    (tmp_path / "elsewhere" / format_name(key(7))).rename(tmp_path / format_name(key(7)))
    (tmp_path / (format_name(key(8)) + ".tmp.0001")).write_bytes(b"partial")
    corrupt_file(store.path_for(key(3)), "flip")
    problems = "\n".join(store.check(deep=True))
    assert f"indexed but not on disk: {store.path_for(key(0))}" in problems
    assert f"size of {store.path_for(key(1))}" in problems
    assert f"indexed but not on disk: {store.path_for(key(2))}" in problems
    assert "quarantined but verifies" in problems
    assert f"on disk but not indexed: {store.path_for(key(7))}" in problems
    assert "temp file left" in problems
    assert f"{store.path_for(key(3))} fails verification: payload-checksum" in problems
    assert store.check(deep=False) != [] and "fails verification" not in "".join(store.check())
    store.close()


class FailingScans:
    """``scan_root`` that raises for its first ``failures`` calls (an unreadable directory, an
    I/O error mid-walk), then walks as usual."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self._real = scanner_module.scan_root

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(5, "Input/output error", "cache/ab")
        return self._real(*args, **kwargs)  # type: ignore[arg-type]


def test_a_failed_scan_refuses_stores_until_a_scan_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = open_store(tmp_path)
    for i in range(3):
        assert first.put(key(i), payload(i)) == "stored"
    on_disk = first.used_bytes
    first.close()
    scans = FailingScans(failures=2)
    monkeypatch.setattr(scanner_module, "scan_root", scans)
    monkeypatch.setattr(scanner_module, "SCAN_RETRY_S", 0.2)
    # room for exactly one more; the walk is what fails here, so no snapshot may stand in for it
    store = KvFileStore(tmp_path, on_disk + HEADER_SIZE + 8192, scan_snapshot=False)
    track(store)
    store.open(background_scan=True)
    deadline = time.monotonic() + 10
    while store.scan_error is None:
        assert time.monotonic() < deadline, "the scan failure was never reported"
        time.sleep(0.01)
    assert "Input/output error" in store.status()["scan_error"]
    assert store.check() == [f"the start-up scan failed: {store.scan_error}"]
    # Files already on disk are not counted yet: a store now could pass the cap unseen.
    assert store.put(key(9), payload(9)) == "rejected-scanning"
    assert not store.path_for(key(9)).exists()
    assert store.contains(key(1))  # lookups are answered from the disk meanwhile
    assert store.wait_scan(10), "the scan was not tried again after failing"
    assert scans.calls == 3 and store.scan_error is None
    assert store.status()["scan_failures"] == 2
    assert store.used_bytes == on_disk
    assert store.put(key(9), payload(9)) == "stored"
    assert store.put(key(10), payload(10)) == "rejected-capacity"  # the cap holds
    assert store.used_bytes == on_disk + HEADER_SIZE + 8192


def test_the_walker_is_validated_where_it_is_set(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown walker 'rust'"):
        KvFileStore(tmp_path, 10**9, walker="rust")
    with pytest.raises(ValueError, match="walk_threads"):
        KvFileStore(tmp_path, 10**9, walk_threads=-1)
    assert open_store(tmp_path, walker="python").put(key(1), payload(1)) == "stored"
