"""The one atomic writer: complete files or none, and never a temp file left by a failure."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.atomic import TMP_MARK, write_atomic, write_text_atomic


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def test_publishes_bytes_chunks_and_text(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a", b"one")
    write_atomic(tmp_path / "b", [b"x" * 3, memoryview(b"yz"), bytearray(b"!")])
    write_text_atomic(tmp_path / "c", "ünï")
    assert (tmp_path / "a").read_bytes() == b"one"
    assert (tmp_path / "b").read_bytes() == b"xxxyz!"
    assert (tmp_path / "c").read_text(encoding="utf-8") == "ünï"
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o600
    assert leftovers(tmp_path) == []


def test_a_failing_data_source_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f"
    write_atomic(target, b"old")

    def chunks() -> Iterator[bytes]:
        yield b"new part"
        raise RuntimeError("the producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        write_atomic(target, chunks())
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_interrupt_leaves_no_temp(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"a"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "g", chunks())
    assert list(tmp_path.iterdir()) == []


def test_disk_full_raises_enospc_and_leaves_nothing(small_fs: Path) -> None:
    target = small_fs / "big"
    with pytest.raises(OSError) as info:
        write_atomic(target, [b"\0" * (1 << 20)] * 8)  # 8 MiB into a 3 MiB file system
    assert info.value.errno == errno.ENOSPC
    assert list(small_fs.iterdir()) == []
    write_atomic(target, b"fits")  # the space came back
    assert target.read_bytes() == b"fits"


def test_an_unwritable_directory_is_an_error_not_a_partial_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "f", b"x")
    assert list(tmp_path.iterdir()) == []


def test_the_temp_file_is_never_a_followed_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    """A temp name planted as a symlink is refused (O_EXCL|O_NOFOLLOW), not written through."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    monkeypatch.setattr("kvpersist.atomic.temp_name", lambda path, mark=TMP_MARK: tmp_path / "t")
    os.symlink(victim, tmp_path / "t")
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "f", b"evil")
    assert victim.read_bytes() == b"keep" and not (tmp_path / "f").exists()
