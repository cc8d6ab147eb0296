"""Ending the processes a test runs, and knowing when they can do nothing more.

Invariants
----------
* A process is *gone* only when every one of its threads has exited: it was reaped, its pid
  now names a later process (another start time), or all that is left is its zombie thread-group
  leader.  A leader that shows as a zombie is not enough: after SIGKILL the leader turns into a
  zombie at once while the process's other threads are still exiting, and its file descriptors
  (sockets, the root lock) and memory are released only when the last of them has (seen: a
  killed LMCache server whose request socket still accepted after its leader was a zombie).
  :func:`kvpersist.serving.pidfile.wait_exited` stops at the zombie leader, so it is not used here.
* A process is only ever signalled as the one its pid file records (pid and start time), never
  by a pid that may since belong to another program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from ..config.server import ServerSettings
from ..serving.pidfile import check_pid_file


def _stat(pid: int) -> tuple[str, int] | None:
    """State letter and start time (clock ticks since boot) of ``pid``; None if there is none."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return rest[0], int(rest[19])  # fields 3 and 22 (comm, field 2, may hold spaces and ')')


def gone(pid: int, ticks: int) -> bool:
    """True once process ``pid`` that started at ``ticks`` has exited with all its threads (see
    module invariants); reaps it if it is our child."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # a child's zombie is reaped only once all threads are done
    stat = _stat(pid)
    if stat is None or stat[1] != ticks:
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat[0] in ("Z", "X") and tasks == [str(pid)]


def wait_gone(pid: int, timeout: float, *, ticks: int | None = None,
              interval: float = 0.02) -> bool:
    """Wait until process ``pid`` (started at ``ticks``; default: whichever runs now) is
    :func:`gone`; False on timeout.  Never signals anything."""
    if ticks is None:
        stat = _stat(pid)
        if stat is None:
            return True
        ticks = stat[1]
    deadline = time.monotonic() + timeout
    while not gone(pid, ticks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def server_pid(settings: ServerSettings) -> int:
    """The pid of the server that ``settings``' pid file records, asserted to be running (the
    very process recorded: pid and start time)."""
    status = check_pid_file(settings.pid_file)
    assert status.running and status.record is not None, status.describe(settings.pid_file)
    return status.record.pid


def kill_server(settings: ServerSettings, sig: int = signal.SIGKILL,
                timeout: float = 30.0) -> int:
    """Send ``sig`` (one that ends the process) to the server that ``settings``' pid file
    records as running, and return its pid once that process is gone.

    Invariant: on return every thread of the recorded process (pid *and* start time, so never a
    reused pid) has exited: it can write nothing more, and its memory, sockets and root lock
    are released.  The pid file is left in place, stale, as a crash leaves it; the log relay
    may still be writing the server's last output.  AssertionError if no running server is
    recorded or it is not gone within ``timeout`` seconds."""
    status = check_pid_file(settings.pid_file)
    assert status.running and status.record is not None, status.describe(settings.pid_file)
    record = status.record
    os.kill(record.pid, sig)
    assert wait_gone(record.pid, timeout, ticks=record.start_ticks), (
        f"server pid {record.pid} still runs {timeout:.0f}s after signal {sig}")
    return record.pid
