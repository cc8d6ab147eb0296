"""O_DIRECT reads (``direct_io``): the same verified bytes as buffered reads, into aligned and
unaligned buffers and with a tail shorter than a page; a corrupt file is still caught; a file
system that refuses O_DIRECT falls back to buffered reads with a log line."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.l2.layout import KeyFields
from kvpersist.l2.read_loop import PAGE as DIRECT_ALIGN
from kvpersist.l2.read_loop import is_page_aligned as is_aligned
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.corruption import EXPECTED_REASON, corrupt_file

NS = "kvp-" + "d" * 32
#: the page cache's disk here: /tmp is on the VM's block device (ext4), which takes O_DIRECT
DISK_DIR = Path(tempfile.gettempdir())


def key(i: int) -> KeyFields:
    return KeyFields(f"org/model/{NS}", 0x01000100, 0, i.to_bytes(32, "big"), "")


def payload(i: int, size: int) -> bytes:
    return bytes((i * 13 + j * 7) % 251 for j in range(size))


@pytest.fixture
def disk_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=DISK_DIR) as d:
        yield Path(d)


def aligned_buffer(size: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, max(size, 1)))[:size]
    assert is_aligned(view)
    return view


def unaligned_buffer(size: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, size + 16))[16:16 + size]
    assert not is_aligned(view)
    return view


@pytest.mark.parametrize("size", [3 * (1 << 20), (1 << 20) + 100, 5000, 512])
@pytest.mark.parametrize("make", [aligned_buffer, unaligned_buffer])
def test_direct_reads_give_the_verified_bytes(disk_root: Path, size: int, make: object) -> None:
    store = KvFileStore(disk_root, 10**9, direct_io=True)
    store.open(background_scan=False)
    try:
        data = payload(size, size)
        assert store.put(key(1), data) == "stored"
        out = make(size)  # type: ignore[operator]
        assert store.read_into(key(1), out)
        assert bytes(out) == data
        assert store.direct_io, "the disk refused O_DIRECT: the direct path was not tested"
        assert store.check() == []
    finally:
        store.close()


@pytest.mark.parametrize("size", [2 * DIRECT_ALIGN * 64 + 77, 3 * (1 << 20) + 77])
@pytest.mark.parametrize("how", ["flip", "noise", "half", "last-byte"])
def test_a_corrupt_file_is_caught_on_the_direct_path(disk_root: Path, size: int,
                                                      how: str) -> None:
    """Below one verify segment, and above it (the aligned payload read in one request, the
    unaligned tail through the bounce buffer): damage at the start, all over, a truncation, and
    in the tail's last byte are each a verified miss with their reason."""
    store = KvFileStore(disk_root, 10**9, direct_io=True)
    store.open(background_scan=False)
    try:
        assert store.put(key(2), payload(2, size)) == "stored"
        path = store.path_for(key(2))
        if how == "last-byte":
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0x01
            path.write_bytes(bytes(raw))
        else:
            corrupt_file(path, how)
        assert not store.read_into(key(2), aligned_buffer(size))
        reason = "payload-checksum" if how == "last-byte" else EXPECTED_REASON[how]
        assert store.status()["verify_failures_by_reason"] == {reason: 1} and store.direct_io
        assert store.check() == []
    finally:
        store.close()


def test_a_file_system_refusing_o_direct_falls_back_with_a_log_line(
        disk_root: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """tmpfs takes O_DIRECT since Linux 6.6 (this kernel does), so the refusal older kernels and
    some FUSE file systems give (EINVAL at open) is simulated at ``os.open``."""
    real_open = os.open

    def refusing(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    store = KvFileStore(disk_root, 10**9, direct_io=True)
    store.open(background_scan=False)
    try:
        data = payload(3, 70_000)
        assert store.put(key(3), data) == "stored"
        monkeypatch.setattr(os, "open", refusing)
        out = aligned_buffer(len(data))
        assert store.read_into(key(3), out) and bytes(out) == data
        assert not store.direct_io and store.status()["direct_io"] is False
        assert "O_DIRECT reads refused" in caplog.text
        monkeypatch.setattr(os, "open", real_open)
        assert store.check() == []
    finally:
        store.close()
