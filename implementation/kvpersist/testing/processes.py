"""Ending the processes a test runs, and knowing when they can do nothing more.

Invariants
----------
* A process is *gone* only when every one of its threads has exited: it was reaped, its pid
  now names a later process (another start time), or all that is left is its zombie thread-group
  leader.  A leader that shows as a zombie is not enough: after SIGKILL the leader turns into a
  zombie at once while the process's other threads are still exiting, and its file descriptors
  (sockets, the root lock) and memory are released only when the last of them has (seen: a
  killed LMCache server whose request socket still accepted after its leader was a zombie).
  :func:`kvpersist.serving.pidfile.wait_exited` waits for exactly that.
* A process is only ever signalled as the one its pid file records (pid and start time), never
  by a pid that may since belong to another program.
"""

from __future__ import annotations

import os
import signal

from ..config.server import ServerSettings
from ..serving.pidfile import check_pid_file, wait_exited


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
    assert wait_exited(record.pid, timeout, ticks=record.start_ticks), (
        f"server pid {record.pid} still runs {timeout:.0f}s after signal {sig}")
    return record.pid
