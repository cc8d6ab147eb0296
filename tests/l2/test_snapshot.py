"""The index snapshot: a clean close leaves the tree's scan, the next open adopts it only while
the tree is provably unchanged, and anything else walks the disk.  Each test ends on the
store's ``check()`` oracle, so a snapshot that counted the wrong files fails it."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from kvpersist.l2 import snapshot as snapshot_module
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import STATE_DIR, KeyFields
from kvpersist.l2.scan import scan_root
from kvpersist.l2.snapshot import SNAPSHOT_NAME, decode, snapshot_path
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.checked_stores import open_checked_store, untrack

NS = "kvp-" + "c" * 32


def key(i: int) -> KeyFields:
    return KeyFields(f"org/model/{NS}", 0x01000100, 0, (i * 7919 + 1).to_bytes(32, "big"))


def payload(i: int, size: int = 4096) -> bytes:
    return bytes((i * 17 + j) % 251 for j in range(size))


# Each test ends on ``KvFileStore.check()`` of the stores it opened (tests/l2/conftest.py).
opened = open_checked_store


def filled(root: Path, n: int = 6, **kw: object) -> KvFileStore:
    store = opened(root, **kw)
    for i in range(n):
        assert store.put(key(i), payload(i)) == "stored"
    return store


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvp") if "quarantine" not in p.parts)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_clean_restart_adopts_the_snapshot_with_the_same_count_and_order(
        tmp_path: Path, sharded: bool) -> None:
    store = filled(tmp_path, sharded=sharded)
    time.sleep(0.05)  # past the file system's clock tick of the stores
    assert store.read_into(key(0), bytearray(4096))  # key 0 becomes the most recently used
    assert store.index.ordered()[0][-1] == key(0)
    store.close()
    assert snapshot_path(tmp_path).is_file()
    walked = scan_root(tmp_path, sharded=sharded, remove_temps=False)
    again = opened(tmp_path, sharded=sharded)
    assert again.status()["scan_source"] == "snapshot"
    assert not snapshot_path(tmp_path).exists()  # used at most once
    assert again.used_bytes == disk_bytes(tmp_path) == 6 * (HEADER_SIZE + 4096)
    order = again.index.ordered()[0]
    assert order == list(walked.files) and order[-1] == key(0)  # a scan's LRU order (file mtimes)
    assert again.put(key(99), payload(99)) == "stored"


def test_a_file_added_while_stopped_voids_the_snapshot(tmp_path: Path) -> None:
    """An operator copies a file in while the server is stopped: counted, not missed."""
    other = filled(tmp_path / "other", n=1)
    other.put(key(50), payload(50))
    other.close()
    filled(tmp_path / "root").close()
    shutil.copy2(other.path_for(key(50)), tmp_path / "root" / other.path_for(key(50)).name)
    store = opened(tmp_path / "root")
    assert store.status()["scan_source"] == "disk"
    assert store.contains(key(50))
    assert store.used_bytes == disk_bytes(tmp_path / "root") == 7 * (HEADER_SIZE + 4096)


@pytest.mark.parametrize("where", ["existing shard", "new shard"])
def test_a_file_added_to_a_shard_directory_voids_the_snapshot(tmp_path: Path, where: str) -> None:
    store = filled(tmp_path / "root", sharded=True)
    store.close()
    # key(60) shards into the keys' existing 00/00; this one into ab/cd, which does not exist
    added = key(60) if where == "existing shard" else key(60)._replace(
        chunk_hash=b"\xab\xcd" + bytes(30))
    donor = opened(tmp_path / "donor", sharded=True)
    assert donor.put(added, payload(60)) == "stored"
    source = donor.path_for(added)
    target = tmp_path / "root" / source.relative_to(tmp_path / "donor")
    assert target.parent.exists() == (where == "existing shard")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    again = opened(tmp_path / "root", sharded=True)
    assert again.status()["scan_source"] == "disk"
    assert again.contains(added)
    assert again.used_bytes == disk_bytes(tmp_path / "root") == 7 * (HEADER_SIZE + 4096)


def test_a_file_removed_while_stopped_voids_the_snapshot(tmp_path: Path) -> None:
    store = filled(tmp_path)
    victim = store.path_for(key(3))
    store.close()
    victim.unlink()
    again = opened(tmp_path)
    assert again.status()["scan_source"] == "disk"
    assert not again.contains(key(3))
    assert again.used_bytes == 5 * (HEADER_SIZE + 4096)


def test_the_snapshot_is_what_the_disk_holds_not_what_the_index_believes(tmp_path: Path) -> None:
    """A file removed under a running store: the index still counts it, the snapshot (a walk
    at close) does not."""
    store = filled(tmp_path)
    store.path_for(key(1)).unlink()
    assert store.contains(key(1))
    store.close()
    again = opened(tmp_path)
    assert again.status()["scan_source"] == "snapshot"
    assert not again.contains(key(1))
    assert again.used_bytes == disk_bytes(tmp_path) == 5 * (HEADER_SIZE + 4096)


def test_a_corrupt_snapshot_is_ignored_and_the_disk_walked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    filled(tmp_path).close()
    path = snapshot_path(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(raw)
    with caplog.at_level(logging.INFO, "kvpersist.l2"):
        store = opened(tmp_path)
    assert store.status()["scan_source"] == "disk"
    assert "checksum mismatch" in caplog.text
    assert store.used_bytes == 6 * (HEADER_SIZE + 4096)


def test_a_snapshot_is_decoded_whole_or_refused(tmp_path: Path) -> None:
    filled(tmp_path).close()
    raw = snapshot_path(tmp_path).read_bytes()
    snap = decode(raw)
    assert len(snap) == 6 and snap.used_bytes == 6 * (HEADER_SIZE + 4096) and not snap.sharded
    for bad in (raw[:-1], b"X" + raw[1:], raw[:40]):
        with pytest.raises(ValueError):
            decode(bad)
    opened(tmp_path)  # the snapshot is still there: the open adopts it


def test_no_snapshot_while_a_temp_file_is_in_a_data_directory(tmp_path: Path) -> None:
    store = filled(tmp_path)
    temp = tmp_path / (store.path_for(key(0)).name + ".tmp.0123456789ab")
    temp.write_bytes(b"partial")
    store.close()
    assert not snapshot_path(tmp_path).exists()
    again = opened(tmp_path)  # walks the disk and removes the leftover
    assert again.status()["scan_source"] == "disk" and not temp.exists()


def test_racy_stamps_write_no_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory whose mtime is not older than the file system's clock at stamping could
    change again within the same tick unseen: no snapshot then."""
    store = filled(tmp_path)
    real = snapshot_module.stamp_tree

    def stamps_in_the_future(root: Path, sharded: bool) -> list[tuple[str, int, int]]:
        return [(rel, ino, mtime + 10**12) for rel, ino, mtime in real(root, sharded)]

    monkeypatch.setattr(snapshot_module, "stamp_tree", stamps_in_the_future)
    monkeypatch.setattr(snapshot_module, "_RACY_RETRY_S", 0.0)
    store.close()
    assert not snapshot_path(tmp_path).exists()
    assert not any((tmp_path / STATE_DIR).iterdir())  # the temp file is gone too
    monkeypatch.undo()
    assert opened(tmp_path).status()["scan_source"] == "disk"


def test_a_crash_leaves_no_snapshot_to_adopt(tmp_path: Path) -> None:
    """The snapshot is removed when a store opens; a store that then dies without closing
    (SIGKILL) leaves none, and the next open walks the disk it changed."""
    filled(tmp_path).close()
    store = opened(tmp_path)
    assert store.put(key(40), payload(40)) == "stored"
    assert not snapshot_path(tmp_path).exists()
    os.close(store._lock_fd)  # what the kernel does for a killed process
    store._lock_fd = -1
    untrack(store)
    again = opened(tmp_path)
    assert again.status()["scan_source"] == "disk"
    assert again.used_bytes == 7 * (HEADER_SIZE + 4096)


def test_a_snapshot_of_another_layout_is_not_adopted(tmp_path: Path) -> None:
    filled(tmp_path).close()
    store = opened(tmp_path, sharded=True)
    assert store.status()["scan_source"] == "disk"
    assert store.used_bytes == 6 * (HEADER_SIZE + 4096)
    store.close()  # its own snapshot says sharded, so the flat store below walks the disk too
    assert opened(tmp_path).status()["scan_source"] == "disk"


def test_leftovers_of_a_killed_writer_are_removed_at_open(tmp_path: Path) -> None:
    filled(tmp_path).close()
    leftover = tmp_path / STATE_DIR / f"{SNAPSHOT_NAME}.tmp.4242"
    leftover.write_bytes(b"half a snapshot")
    store = opened(tmp_path)
    assert store.status()["scan_source"] == "snapshot" and not leftover.exists()


def test_snapshots_off_or_on_a_shared_tree_leave_none(tmp_path: Path) -> None:
    filled(tmp_path / "off", scan_snapshot=False).close()
    assert not snapshot_path(tmp_path / "off").exists()
    part = tmp_path / "tree" / "nodes" / "a"
    filled(part, shared_tree=tmp_path / "tree").close()
    assert not snapshot_path(part).exists()
