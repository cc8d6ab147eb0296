"""The server's log relay: the LMCache server writes its output into a pipe, and a small process
of its own appends it to ``lmcache-server.log``.

Why: the log lives in the cache root, on the device that restores read from.  Appending a line
to a file whose last page is not in memory (after a page-cache drop, or under memory pressure)
first *reads* that page, and that read waits in the device's queue behind the restore's reads.
Measured here on a device read at 5 MiB/s with six 16 MiB reads in flight: the first append took
3.5 s.  A server writing its log directly held Python's logging lock across that wait, so every
thread that logs stalled with it, uvicorn's event loop included (its access line), and
``/status`` stopped answering: the connector's progress probe saw no answer and bypassed a restore
that was progressing (``progress probe: 0/2 polls answered``).

Invariants
----------
* The server never waits on the log's device: its stdout and stderr are the write end of a pipe
  (1 MiB where the kernel allows); only when the relay has fallen a whole pipe behind does a
  write block.
* Every byte the server wrote reaches the log unless the log cannot be written: the relay runs
  until the last writer closes the pipe, in a session of its own (a signal to the server's
  process group does not cut off the server's last lines; it ignores SIGINT, SIGTERM and SIGHUP
  once running), and it survives the server's death, ``kill -9`` included.
* A failed write (disk full, I/O error) drops that data, not the relay: the pipe keeps draining,
  so the server never blocks on a full disk, and the next successful write is preceded by one
  line that says how many bytes were lost and why.
* The log is bounded (``KVP_LOG_MAX_MB``, ``KVP_LOG_BACKUPS``): before a write would take it past
  its size (by at most the rest of the line in progress), the relay renames it to ``.1``
  (older ones move up, the oldest beyond the count is removed) and continues in a new file
  created 0600, never through a symlink.  A failed rotation keeps writing to the current file
  and says so in it once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: The pipe size asked for (Linux's default cap for unprivileged processes is 1 MiB).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_READ_BYTES = 1 << 16


LOG_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Rotation:
    """Where the log is and how large it may grow (see the module invariants)."""

    path: Path
    max_bytes: int
    backups: int
    failed: str = ""

    def backup(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def rotate(self, sink: int) -> int:
        """Move the log aside and return the new file's descriptor (``sink`` on failure)."""
        try:
            if self.backups == 0:
                self.path.unlink(missing_ok=True)
            else:
                self.backup(self.backups).unlink(missing_ok=True)
                for n in range(self.backups - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(self.backup(n), self.backup(n + 1))
                os.rename(self.path, self.backup(1))
            fresh = os.open(self.path, LOG_FLAGS, 0o600)
        except OSError as exc:
            if not self.failed:
                self.failed = exc.strerror or str(exc)
                _write_all(sink, f"[kvpersist log relay] cannot rotate {self.path}: "
                                 f"{self.failed}; writing on\n".encode())
            return sink
        os.close(sink)
        return fresh


def relay(source: int, sink: int, rotation: Rotation | None = None) -> int:
    """Copy ``source`` to ``sink`` until end of file, rotating the log when ``rotation``
    says; returns the bytes dropped."""
    dropped, reason = 0, ""
    size = os.fstat(sink).st_size if rotation is not None else 0
    while True:
        data = os.read(source, _READ_BYTES)
        if not data:
            return dropped
        if rotation is not None and size and size + len(data) > rotation.max_bytes:
            # The line in progress ends in the old file, so no line is split between two
            # (unless it is longer than the bound itself).
            newline = data.find(b"\n")
            cut = newline + 1 if 0 <= newline < 2 * rotation.max_bytes - size else 0
            if cut:
                error = _write_all(sink, data[:cut])
                if error is not None:
                    dropped, reason = dropped + cut, error
                data = data[cut:]
            rotated = rotation.rotate(sink)
            if rotated != sink:
                sink, size = rotated, 0
        size += len(data)
        if dropped:
            note = (f"[kvpersist log relay] {dropped} bytes of server output were lost: "
                    f"{reason}\n").encode()
            if _write_all(sink, note) is None:
                dropped = 0
        error = _write_all(sink, data)
        if error is not None:
            dropped, reason = dropped + len(data), error


def _write_all(fd: int, data: bytes) -> str | None:
    """None when all of ``data`` was written, else the error's words."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@dataclass
class LogRelay:
    """A started relay: give ``write_fd`` to the server as stdout and stderr, then call
    :meth:`release` (the relay must see end of file once the server is gone)."""

    proc: subprocess.Popen[bytes]
    write_fd: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        """Close this process's write end (idempotent)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def drained(self, timeout_s: float) -> bool:
        """Wait until the relay has written everything and exited; False on timeout."""
        self.release()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True


def start_log_relay(log_fd: int, *, python: str = sys.executable,
                    rotation: Rotation | None = None) -> LogRelay:
    """A relay appending to ``log_fd`` (kept open by the relay; the caller may close it), which
    is the file ``rotation.path`` when rotation is asked for."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, _F_SETPIPE_SZ, PIPE_BYTES)
    try:
        proc = subprocess.Popen(
            [python, "-m", "kvpersist.serving.server.log_relay",
             *([] if rotation is None else
               ["--path", str(rotation.path), "--max-bytes", str(rotation.max_bytes),
                "--backups", str(rotation.backups)])],
            stdin=read_fd, stdout=log_fd, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd="/",
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return LogRelay(proc, write_fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.serving.server.log_relay",
        description="Copy stdin to stdout (the server log) until end of file; with --path, "
                    "rotate the log at --max-bytes keeping --backups old files.")
    parser.add_argument("--path", type=Path, help="the log file stdout is open on")
    parser.add_argument("--max-bytes", type=int, default=0)
    parser.add_argument("--backups", type=int, default=0)
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    rotation = (Rotation(args.path, args.max_bytes, args.backups)
                if args.path is not None and args.max_bytes > 0 else None)
    relay(0, 1, rotation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
