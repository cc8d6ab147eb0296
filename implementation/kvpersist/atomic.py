"""Atomic file publication: the one helper every layer uses to write a file readers may open.

Invariants
----------
* Readers see either no file (or the previous one) at ``path``, or the complete new content:
  the data go to ``<name><tmp_mark><12 hex>`` in the same directory, which is then renamed over
  ``path``.
* Whatever fails (a write error such as ENOSPC, an exception raised by the caller's data
  iterator, a KeyboardInterrupt), the temp file is removed before the error propagates: this
  helper never leaves a temp file behind.  Only a process killed mid-write can; its leftovers
  carry ``tmp_mark`` in their names so that the owner's start-up scan can recognize them.
* The temp file is created with ``O_EXCL | O_NOFOLLOW`` and ``mode`` (0600 by default), so it is
  never written through a symlink nor readable by others while it is being written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

Chunk = bytes | bytearray | memoryview
TMP_MARK = ".tmp."


def temp_name(path: Path, tmp_mark: str = TMP_MARK) -> Path:
    return path.with_name(f"{path.name}{tmp_mark}{secrets.token_hex(6)}")


def write_atomic(path: str | Path, data: Chunk | Iterable[Chunk], *, mode: int = 0o600,
                 fsync: bool = False, tmp_mark: str = TMP_MARK,
                 before_rename: Callable[[], None] | None = None) -> None:
    """Publish ``data`` (bytes, or an iterable of byte chunks) at ``path`` atomically.

    ``fsync``: flush the file to stable storage before the rename (the rename itself is not
    fsynced: a crash may lose the new file, never expose a partial one).  ``before_rename``:
    called once every byte is written; what it raises leaves no file and propagates.
    """
    target = Path(path)
    tmp = temp_name(target, tmp_mark)
    chunks: Iterable[Chunk] = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            for chunk in chunks:
                _write_all(fd, chunk)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        os.rename(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str, *, mode: int = 0o600) -> None:
    write_atomic(path, text.encode("utf-8"), mode=mode)


def write_record_text(path: Path, text: str) -> Path:
    """Write a small metadata record atomically into its (0700) folder, only when its content
    changes; returns ``path``."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return path
    except OSError:
        pass
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_text_atomic(path, text)
    return path


def _write_all(fd: int, data: Chunk) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]
