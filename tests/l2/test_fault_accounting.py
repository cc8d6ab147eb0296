"""Faults never shift the accounting (issue 35): only absence removes a key; every other error is
a counted miss that leaves index and disk as they were; a persistent media error quarantines;
quarantine acts on the inode that was read; a scan that could not read the data fails.

Each test ends on ``KvFileStore.check(deep=True)`` (tests/l2/conftest.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.l2 import store as store_module
from kvpersist.l2.layout import QUARANTINE_DIR, KeyFields
from kvpersist.l2.scan import unread_data
from kvpersist.l2.store import READ_ERRORS_TO_QUARANTINE, KvFileStore
from kvpersist.testing.checked_stores import open_checked_store

NS = "kvp-" + "f" * 32


def key(i: int) -> KeyFields:
    return KeyFields(f"org/model/{NS}", 0x01000100, 0, i.to_bytes(32, "big"), "")


def payload(i: int, size: int = 8192) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def stored(tmp_path: Path, n: int = 3) -> KvFileStore:
    store = open_checked_store(tmp_path / "root")
    for i in range(n):
        assert store.put(key(i), payload(i)) == "stored"
    return store


def read(store: KvFileStore, i: int) -> bool:
    return store.read_into(key(i), bytearray(8192))


def test_a_failed_open_is_a_counted_miss_that_keeps_the_file_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored(tmp_path)
    used, files = store.used_bytes, len(store)
    real_open = os.open
    for code in (errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EIO):
        def failing(path: object, flags: int, *args: object, code: int = code) -> int:
            if str(path).endswith(".kvp"):
                raise OSError(code, os.strerror(code))
            return real_open(path, flags, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(store_module.os, "open", failing)
        for _ in range(READ_ERRORS_TO_QUARANTINE + 1):  # never the file's fault: no quarantine
            assert not read(store, 1)
        monkeypatch.setattr(store_module.os, "open", real_open)
        assert (store.used_bytes, len(store)) == (used, files), errno.errorcode[code]
        assert read(store, 1)  # the file was never touched
    assert store.status()["read_errors"] == 4 * (READ_ERRORS_TO_QUARANTINE + 1)
    assert store.status()["quarantined"] == 0


def test_a_symlink_in_place_of_a_file_is_an_error_not_an_absence(tmp_path: Path) -> None:
    store = stored(tmp_path)
    path = store.path_for(key(2))
    os.replace(path, tmp_path / "elsewhere.kvp")
    path.symlink_to(tmp_path / "elsewhere.kvp")  # O_NOFOLLOW: ELOOP
    assert not read(store, 2)
    assert key(2) in store.index and store.status()["read_errors"] == 1
    os.replace(tmp_path / "elsewhere.kvp", path)  # put back: the store is whole again
    assert read(store, 2)


def test_an_absent_file_drops_its_key_unless_a_store_published_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored(tmp_path)
    os.unlink(store.path_for(key(0)))  # gone behind the store's back
    assert not read(store, 0) and key(0) not in store.index
    # A reader that saw ENOENT (an eviction) while a store re-published the key: the key stays.
    real = store._read_file
    monkeypatch.setattr(store, "_read_file",
                        lambda path, k, out: store_module._FileRead(absent=True))
    assert not read(store, 1)
    monkeypatch.setattr(store, "_read_file", real)
    assert key(1) in store.index and read(store, 1)


def test_a_persistent_media_error_quarantines_the_file_and_the_key_can_be_stored_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored(tmp_path)
    real = store_module.read_verified
    failing_key = key(1)

    def media_error(fd: int, k: KeyFields, *args: object, **kw: object) -> float:
        if k == failing_key:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, k, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "read_verified", media_error)
    for _ in range(READ_ERRORS_TO_QUARANTINE - 1):
        assert not read(store, 1)
        assert failing_key in store.index  # transient so far: left as it was
    assert store.put(failing_key, payload(1)) == "exists"
    assert not read(store, 1)  # the third in a row
    assert failing_key not in store.index
    quarantined = os.listdir(store.root / QUARANTINE_DIR)
    assert len(quarantined) == 1 and ".read-error." in quarantined[0]
    monkeypatch.setattr(store_module, "read_verified", real)
    assert store.put(failing_key, payload(1)) == "stored" and read(store, 1)  # repaired
    assert store.status()["verify_failures_by_reason"] == {"read-error": 1}


def test_a_success_between_media_errors_starts_the_count_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored(tmp_path)
    real = store_module.read_verified
    fail = [True]

    def flaky(fd: int, k: KeyFields, *args: object, **kw: object) -> float:
        if fail[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, k, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "read_verified", flaky)
    for _ in range(3):
        for _ in range(READ_ERRORS_TO_QUARANTINE - 1):
            assert not read(store, 0)
        fail[0] = False
        assert read(store, 0)
        fail[0] = True
    assert key(0) in store.index and store.status()["quarantined"] == 0


def test_quarantine_acts_on_the_inode_that_was_read(tmp_path: Path) -> None:
    """Two readers of one corrupt file: the second's quarantine finds a good file a new store
    published meanwhile, and leaves it (and its count) alone."""
    store = stored(tmp_path)
    path = store.path_for(key(1))
    with open(path, "r+b") as fh:  # a flipped payload byte
        fh.seek(5000)
        fh.write(b"\xff" if fh.read(1) != b"\xff" else b"\x00")
    stale = store._read_file(path, key(1), memoryview(bytearray(8192)))
    assert stale.error is not None and stale.inode is not None
    assert read(store, 1) is False  # the first reader quarantines the bad file
    assert store.put(key(1), payload(1)) == "stored"  # and a new store publishes a good one
    store._quarantine(path, key(1), "payload-checksum", "the second reader", stale.inode)
    assert path.exists() and key(1) in store.index and read(store, 1)


def test_a_bad_file_that_cannot_be_moved_or_removed_stays_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored(tmp_path)
    path = store.path_for(key(2))
    read_ok = store._read_file(path, key(2), memoryview(bytearray(8192)))

    def refuse(*args: object, **kw: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(store_module, "quarantine_file", refuse)
    monkeypatch.setattr(store_module.os, "unlink", refuse)
    store._quarantine(path, key(2), "payload-checksum", "a read-only file system",
                      read_ok.inode)
    monkeypatch.undo()
    assert path.exists() and key(2) in store.index  # on disk, so still counted


@pytest.mark.parametrize(("line", "sharded", "counts"), [
    ("cannot read directory {root}/ab: Permission denied", True, True),
    ("cannot read directory {root}/ab/cd: Input/output error", True, True),
    ("cannot stat {root}/ab/cd/x.kvp: Stale file handle", True, True),
    ("cannot stat {root}/x.kvp: Input/output error", False, True),
    ("cannot stat {root}/x.kvp: No such file or directory", False, False),  # vanished
    ("cannot read directory {root}/quarantine: Permission denied", False, False),
    ("cannot read directory {root}/operator-notes: Permission denied", True, False),
    ("cannot read directory {root}/ab: Permission denied", False, False),  # flat: not data
])
def test_the_scan_fails_only_on_unread_data(line: str, sharded: bool, counts: bool) -> None:
    root = Path("/srv/kv")
    errors = [line.format(root=root)]
    assert unread_data(errors, root, sharded=sharded) == (errors if counts else [])


SCAN_AS_UNPRIVILEGED = r"""
import json, sys
from kvpersist.l2.store import KvFileStore
from kvpersist.l2.layout import KeyFields
store = KvFileStore(sys.argv[1], 10**9, sharded=True, scan_snapshot=False)  # walk the disk
store.open(background_scan=False)
key = KeyFields("org/model/kvp-" + "f" * 32, 0x01000100, 0, bytes(32), "")
print(json.dumps({"error": store.scan_error, "done": store.scan_done,
                  "put": store.put(key, b"x" * 4096), "check": store.check()}))
store.close()
"""


def test_a_scan_that_cannot_read_a_shard_fails_and_refuses_stores(tmp_path: Path) -> None:
    """A real unreadable directory: the scan runs without the capabilities that let root read
    any directory (setpriv), so mode 000 refuses it as it would refuse any other account."""
    if os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists():
        pytest.skip("needs root and setpriv to drop the DAC override capabilities")
    root = tmp_path / "root"
    store = open_checked_store(root, sharded=True)
    for i in range(1, 9):
        assert store.put(key(i << 240), payload(i)) == "stored"
    used = store.used_bytes
    store.close()
    shard = sorted(p for p in root.glob("??/??") if p.is_dir())[0]
    shard.chmod(0)
    try:
        out = subprocess.run(
            ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
             "--bounding-set=-dac_override,-dac_read_search",
             sys.executable, "-c", SCAN_AS_UNPRIVILEGED, str(root)],
            check=True, capture_output=True, text=True, timeout=120)
    finally:
        shard.chmod(0o700)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["done"] is False and "could not read 1 entry" in result["error"]
    assert str(shard) in result["error"] and result["put"] == "rejected-scanning"
    assert result["check"] == [f"the start-up scan failed: {result['error']}"]
    again = open_checked_store(root, sharded=True)  # readable again: every file counted
    assert again.used_bytes == used and again.scan_error is None


def test_the_quarantine_is_bounded_and_counts_against_the_cap(tmp_path: Path) -> None:
    """Room for one quarantined file: the second bad file is removed, not kept; and a store is
    refused when the index and the quarantine together would pass the cap."""
    size = 4096 + 8192  # header + payload
    store = open_checked_store(tmp_path / "root", capacity=4 * size,
                               quarantine_max_bytes=size)
    for i in range(3):
        assert store.put(key(i), payload(i)) == "stored"
    for i in (0, 1):  # two files fail their checks
        with open(store.path_for(key(i)), "r+b") as fh:
            fh.seek(5000)
            fh.write(b"\x00\x01\x02")
        assert not read(store, i)
    kept = os.listdir(store.root / QUARANTINE_DIR)
    assert len(kept) == 1 and not store.path_for(key(1)).exists()
    assert store.status()["quarantine_bytes"] == size
    # index 1 file + quarantine 1 file of a 4-file cap: two more fit, a third does not
    assert [store.put(key(i), payload(i)) for i in (3, 4, 5)] == [
        "stored", "stored", "rejected-capacity"]


def test_a_file_replaced_between_the_check_and_the_move_is_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the inode check cannot close: a new store publishes the key after the check and
    before the rename; the new file is moved back, and the key stays indexed."""
    store = stored(tmp_path)
    path = store.path_for(key(1))
    with open(path, "r+b") as fh:
        fh.seek(5000)
        fh.write(b"\x00\x01\x02")
    bad = store._read_file(path, key(1), memoryview(bytearray(8192)))
    good = tmp_path / "good.kvp"
    os.link(path, tmp_path / "bad-copy")  # keep the bad inode's number from being reused
    real = store_module.quarantine_file

    def racing(root: Path, victim: Path, reason: str) -> Path:
        store_module.publish(good, key(1), memoryview(payload(1)), None, fsync=False)
        os.replace(good, victim)  # a store published the key again
        return real(root, victim, reason)

    monkeypatch.setattr(store_module, "quarantine_file", racing)
    store._quarantine(path, key(1), "payload-checksum", "a racing store", bad.inode)
    monkeypatch.undo()
    assert path.exists() and key(1) in store.index and read(store, 1)
    assert os.listdir(store.root / QUARANTINE_DIR) == []
    os.unlink(tmp_path / "bad-copy")


def test_media_errors_of_a_deleted_file_do_not_count_against_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the model test's longer run: errors counted against a file that was deleted
    (or replaced) made its successor's first errors quarantine it."""
    store = stored(tmp_path)
    real = store_module.read_verified

    def media_error(fd: int, k: KeyFields, *args: object, **kw: object) -> float:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for renew in (lambda: store.delete(key(1)), lambda: None):
        monkeypatch.setattr(store_module, "read_verified", media_error)
        for _ in range(READ_ERRORS_TO_QUARANTINE - 1):
            assert not read(store, 1)
        monkeypatch.setattr(store_module, "read_verified", real)
        renew()
        if key(1) not in store.index:
            assert store.put(key(1), payload(1)) == "stored"
    assert key(1) in store.index and store.status()["quarantined"] == 0
    assert read(store, 1)
