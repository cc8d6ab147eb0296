"""The cache server's CPU priority (``KVP_SERVER_NICE``), applied once at its start.

Why it exists: on a host where vLLM's workers hold every core, the server must still answer.
vLLM's CPU workers at TP > 1 busy-poll their shared-memory broadcast queue (a 1 s spin after
each message) while a request waits on the server, and each is pinned to its core.  On the
2-core CI machine that starved the server for 3-14 s in about one restore of three: every
heartbeat (scheduler and both workers) timed out within 80 ms of each other, the lookup made
no progress and was bypassed after 7 s, and a SCHED_OTHER canary process slept 3-7 s late at
exactly those moments while a SCHED_FIFO one never did.  With the server at nice -10 no
restore of 8 stalled in one run, yet later runs still stalled for up to 9 s (the engine's own
heartbeat threads starve as well): a priority makes it rarer; a core the workers do not hold
is the fix where the host has one.

Invariants
----------
* Applied before LMCache starts any thread, so every server thread inherits it.
* Both the thread's nice value and, where the kernel groups tasks by session
  (``/proc/self/autogroup``), the session's: with autogroup a nice value alone only ranks the
  server's threads against each other.
* A priority that cannot be applied stops the server with a message naming the setting and
  what grants it; nothing is left half applied silently.
"""

from __future__ import annotations

import os
from pathlib import Path

NICE_RANGE = range(-20, 20)
AUTOGROUP = Path("/proc/self/autogroup")


class PriorityError(OSError):
    """The requested priority cannot be applied; the message says why and what to do."""


def apply_nice(nice: int, *, autogroup: Path = AUTOGROUP) -> None:
    """Set this process's nice value (and its autogroup's) to ``nice``; 0 changes nothing."""
    if nice not in NICE_RANGE:
        raise PriorityError(f"KVP_SERVER_NICE={nice} is outside -20..19")
    if nice == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if autogroup.exists():
            autogroup.write_text(f"{nice}\n")
    except PermissionError:
        raise PriorityError(
            f"KVP_SERVER_NICE={nice} needs CAP_SYS_NICE to raise the server's priority (run it "
            "as root, or give the service Nice= and AmbientCapabilities=CAP_SYS_NICE in its "
            "unit); or set KVP_SERVER_NICE=0") from None
