"""O_DIRECT stores (``direct_io``): the file is byte for byte what a buffered publish writes,
from aligned and unaligned payloads, with a tail shorter than a page and a payload larger than
the bounce buffer; a file system that refuses O_DIRECT writes gets buffered ones with a log
line, and no temp file is left by either."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.l2.direct_write import DirectWriteRefused, publish_direct
from kvpersist.l2.files import VERIFY_SEGMENT, publish
from kvpersist.l2.format import HEADER_SIZE, build_header, payload_digest
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.read_loop import is_page_aligned
from kvpersist.l2.store import KvFileStore

NS = "kvp-" + "e" * 32
DISK_DIR = Path(tempfile.gettempdir())  # the VM's block device (ext4): it takes O_DIRECT


def key(i: int) -> KeyFields:
    return KeyFields(f"org/model/{NS}", 0x01000100, 0, i.to_bytes(32, "big"), "")


def pattern(size: int, seed: int) -> bytes:
    return (bytes(range(seed % 251, 251)) + bytes(range(seed % 251))) * (size // 251 + 1)


@pytest.fixture
def disk_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=DISK_DIR) as d:
        yield Path(d)


def buffer_of(data: bytes, aligned: bool) -> memoryview:
    shift = 0 if aligned else 24
    view = memoryview(mmap.mmap(-1, len(data) + shift))[shift:shift + len(data)]
    view[:] = data
    assert is_page_aligned(view) == aligned
    return view


@pytest.mark.parametrize("size", [2 * VERIFY_SEGMENT + 12_345, VERIFY_SEGMENT, 8192, 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_a_direct_publish_writes_the_bytes_a_buffered_one_does(
        disk_root: Path, size: int, aligned: bool) -> None:
    data = pattern(size, size)[:size]
    publish(disk_root / "buffered.kvp", key(1), memoryview(data), None, fsync=False)
    publish(disk_root / "direct.kvp", key(1), buffer_of(data, aligned), None, fsync=True,
            direct=True)
    buffered, direct = (disk_root / n for n in ("buffered.kvp", "direct.kvp"))
    assert direct.stat().st_size == HEADER_SIZE + size
    # the headers differ only in the creation time they record; the payloads are identical
    assert direct.read_bytes()[HEADER_SIZE:] == buffered.read_bytes()[HEADER_SIZE:] == data
    assert sorted(p.name for p in disk_root.iterdir()) == ["buffered.kvp", "direct.kvp"]


def assert_refused_leaving_nothing(folder: Path) -> None:
    """A direct publish into ``folder`` raises DirectWriteRefused and leaves no file."""
    header = build_header(key(2), 10, payload_digest(b"x" * 10))
    bounce = memoryview(mmap.mmap(-1, VERIFY_SEGMENT))
    with pytest.raises(DirectWriteRefused):
        publish_direct(folder / "f.kvp", header, memoryview(b"x" * 10), bounce, fsync=False)
    assert list(folder.iterdir()) == []


def test_a_file_system_without_o_direct_is_refused_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refusing(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing)
    assert_refused_leaving_nothing(tmp_path)


def test_a_write_refused_midway_leaves_no_temp_file(
        disk_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refusing)
    assert_refused_leaving_nothing(disk_root)


def test_the_store_falls_back_to_buffered_writes_once_refused(
        disk_root: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    store = KvFileStore(disk_root, 10**9, direct_io=True)
    store.open(background_scan=False)
    try:
        data = pattern(70_000, 5)[:70_000]
        assert store.put(key(4), data) == "stored" and store.direct_writes
        real_open = os.open

        def refusing(path: object, flags: int, *args: object) -> int:
            if flags & os.O_DIRECT and flags & os.O_CREAT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", refusing)
        assert store.put(key(5), data) == "stored"
        assert not store.direct_writes and "O_DIRECT writes refused" in caplog.text
        monkeypatch.setattr(os, "open", real_open)
        out = bytearray(len(data))
        assert store.read_into(key(5), out) and bytes(out) == data
        assert store.read_into(key(4), out) and bytes(out) == data
        assert store.check() == []
    finally:
        store.close()
