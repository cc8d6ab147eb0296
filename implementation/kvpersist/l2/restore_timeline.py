"""When the adapter last passed each step of a restore, on the host's monotonic clock.

A restore's fixed cost before its first device read is spent partly in LMCache (hashing the
request's tokens, its L1 read locks, the L1 allocation of every chunk) and partly in the
adapter (its lookup, the load's dispatch over the roots' file threads).  These stamps, shown
in the adapter's status as ``last_restore_timeline``, let a client that knows when it sent its
LOOKUP split the time between the two (``benchmarks/bench_roots.py``).

Invariants
----------
* Every value is ``time.monotonic()`` (``CLOCK_MONOTONIC``), which the processes of one host
  share: a client subtracts its own ``time.monotonic()`` at the send.
* The last time of each step is kept.  Concurrent restores mix their steps, so this is a tool
  for one restore at a time (a benchmark, a diagnosis), not a metric.
* Marking costs one clock read and one uncontended lock; it never raises for a step of
  :data:`STEPS`.
"""

from __future__ import annotations

import threading
import time

#: The steps, in the order a restore passes them: the lookup task submitted by LMCache and
#: finished by the adapter, the load task submitted by LMCache, its files handed to the roots'
#: file threads, and the load's last file finished.
STEPS = ("lookup_submitted", "lookup_done", "load_submitted", "load_dispatched", "load_done")


class RestoreTimeline:
    """The last ``time.monotonic()`` of each step of :data:`STEPS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}

    def mark(self, step: str) -> None:
        if step not in STEPS:
            raise ValueError(f"unknown restore step {step!r}; known: {', '.join(STEPS)}")
        now = time.monotonic()
        with self._lock:
            self._at[step] = now

    def snapshot(self) -> dict[str, float]:
        """The steps marked so far, in :data:`STEPS` order."""
        with self._lock:
            return {step: self._at[step] for step in STEPS if step in self._at}
