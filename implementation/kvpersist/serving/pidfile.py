"""Pid files that are never trusted blindly.

Invariants
----------
* A pid file records the pid *and* the process start time (``/proc/<pid>/stat`` field 22).
  A process counts as ours only if both match, so a pid reused by another program is
  reported as stale and is never signalled.
* Pid files are never followed through a symlink, for reading or writing
  (``O_NOFOLLOW``); a symlink in its place is an error, not something to act on.
* Writes are atomic (temp file in the same directory + ``rename``).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_text_atomic


class PidFileError(RuntimeError):
    """The pid file cannot be used safely (symlink, unreadable, malformed)."""


class PidState(enum.Enum):
    ABSENT = "absent"  # no pid file
    RUNNING = "running"  # the recorded process is alive and is the one recorded
    DEAD = "stale: process is gone"
    REUSED = "stale: pid now belongs to another program"


@dataclass(frozen=True)
class PidRecord:
    pid: int
    start_ticks: int
    command: str
    zmq_port: int
    http_port: int
    #: The server's log relay (:mod:`kvpersist.serving.server.log_relay`); 0 when there is none
    #: (``kvp-server run``, whose output goes to the journal) or the file predates it.
    log_relay_pid: int = 0
    #: ``KVP_NODE_ID`` on a shared tree ("" on one node): which node's part this server holds.
    node_id: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


@dataclass(frozen=True)
class PidStatus:
    state: PidState
    record: PidRecord | None

    @property
    def running(self) -> bool:
        return self.state is PidState.RUNNING

    def describe(self, path: Path) -> str:
        if self.record is None:
            return f"no pid file at {path}"
        return f"pid file {path}: pid {self.record.pid} {self.state.value}"


def wait_exited(pid: int, timeout_s: float, *, ticks: int | None = None,
                interval_s: float = 0.02) -> bool:
    """Wait until the process ``pid`` (started at ``ticks``; default: whichever runs now) has
    exited, reaping it if it is our child; False on timeout.  A pid reused by a new process
    counts as exited.  Never signals anything."""
    if ticks is None:
        ticks = process_start_ticks(pid)
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        now = process_start_ticks(pid)
        if now is None and ticks is not None:
            # gone, or a zombie whose last thread just exited: reap it if it is our child (the
            # WNOHANG above can run before the exit is reportable; this wait returns at once)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        if ticks is None or now != ticks:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (comm) may contain spaces and parentheses; fields after the last ')' are fixed.
    rest = stat.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state); start time is field 22 → rest[19].
    if rest[0] in ("Z", "X") and _only_the_leader_left(pid):
        return None  # exited with every thread: its memory and descriptors are released
    return int(rest[19])


def _only_the_leader_left(pid: int) -> bool:
    """Whether the zombie thread-group leader ``pid`` is all that is left of its process.
    After SIGKILL the leader is a zombie at once while the other threads are still exiting,
    and the process's memory and file descriptors (sockets, the root lock) are released only
    when the last of them has (seen: a killed server's socket still accepting)."""
    try:
        return os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return True


def write_pid_file(path: Path, record: PidRecord) -> None:
    """Atomically write ``record`` to ``path`` (never through a symlink)."""
    write_text_atomic(path, record.to_json() + "\n")


def read_pid_file(path: Path) -> PidRecord | None:
    """The record in ``path``; None if absent.  Raises PidFileError if unsafe or malformed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if path.is_symlink():
            raise PidFileError(
                f"{path} is a symlink; refusing to follow it. Remove it by hand after checking"
            ) from None
        raise PidFileError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd) as fh:
        text = fh.read(4096)
    try:
        data = json.loads(text)
        return PidRecord(
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            command=str(data["command"]),
            zmq_port=int(data["zmq_port"]),
            http_port=int(data["http_port"]),
            log_relay_pid=int(data.get("log_relay_pid", 0)),
            node_id=str(data.get("node_id", "")),
        )
    except (ValueError, KeyError, TypeError):
        raise PidFileError(
            f"{path} is not a kvpersist pid file ({text[:60]!r}); check and remove it by hand"
        ) from None


def check_pid_file(path: Path) -> PidStatus:
    record = read_pid_file(path)
    if record is None:
        return PidStatus(PidState.ABSENT, None)
    ticks = process_start_ticks(record.pid)
    if ticks is None:
        return PidStatus(PidState.DEAD, record)
    if ticks != record.start_ticks:
        return PidStatus(PidState.REUSED, record)
    return PidStatus(PidState.RUNNING, record)


def remove_pid_file(path: Path, expected: PidRecord | None) -> bool:
    """Remove ``path`` only if it still holds ``expected`` (or anything, if None)."""
    try:
        current = read_pid_file(path)
    except PidFileError:
        return False
    if current is None or (expected is not None and current != expected):
        return False
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True
