"""Which process serves a cache server's socket, and whether that very process is gone.

A worker that handed the server a transfer into its own KV memory may let vLLM reuse those
blocks only once the server answered, or once the process that took the transfer can write
no more (:mod:`kvpersist.serving.connector.worker.load_fence`).  "The socket accepts" does not say *which*
process accepts: a server restarted on the same path never heard of the old transfer, and a
stopped one still accepts.  So the process is named by its kernel identity.

Invariants
----------
* :func:`listener_of` names the process that listens on a Unix socket by ``SO_PEERCRED``
  (the credentials the listener had when it called ``listen``), with its start time from
  ``/proc/<pid>/stat``, so a recycled pid is never taken for the same process.  It returns
  None where the kernel cannot say: a TCP URL, nobody listening, another pid namespace
  (``SO_PEERCRED`` reports pid 0 there).
* :meth:`ServerProcess.gone` is True only when that process can no longer touch memory: its
  ``/proc`` entry is missing, belongs to a later process, or is a zombie leader with no other
  thread left (then its memory and file descriptors are released, and it waits only to be
  reaped; a zombie leader whose other threads still exit is not gone), as
  :func:`kvpersist.serving.pidfile.process_start_ticks` reads it.
* Nothing here sends a byte to the server; a connection is opened and closed at once.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from ...http import UNIX_SCHEME, split_unix_url
from ...pidfile import process_start_ticks

_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class ServerProcess:
    """One process, by pid and start time (clock ticks since boot)."""

    pid: int
    started: int

    def gone(self) -> bool:
        """True when this process has exited (see module invariants)."""
        return process_start_ticks(self.pid) != self.started

    def __str__(self) -> str:
        return f"pid {self.pid}"


def process(pid: int) -> ServerProcess | None:
    """``pid`` as a :class:`ServerProcess`, or None if no such process runs (or a zombie)."""
    ticks = process_start_ticks(pid)
    return None if ticks is None else ServerProcess(pid, ticks)


def listener_of(url: str | None, *, timeout: float = 0.2) -> ServerProcess | None:
    """The process listening on ``url``'s Unix socket, or None (see module invariants)."""
    if not url or not url.startswith(UNIX_SCHEME):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(split_unix_url(url)[0])
        pid, _uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    finally:
        sock.close()
    return process(pid) if pid > 0 else None
