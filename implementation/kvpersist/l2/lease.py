"""How long an L2 task may still touch the L1 buffers LMCache handed it.

LMCache 0.5.6 guards the L1 object of a store task with a read lock and the staging object of
a load task with a write lock, both taken before the task is submitted, and both *TTL locks*:
once ``--l1-read-ttl-seconds`` (300 s) or ``--l1-write-ttl-seconds`` (600 s) have passed the
lock counts as released whatever the adapter is doing, eviction may free the object, and the
allocator hands its memory to the next chunk at once.  A store that reads its object after that
would write another chunk's bytes, hashed as its own, under its key: a file that verifies and
is wrong, a wrong hit after the next restart.  A load that writes after that writes into
another chunk's memory.

Invariants
----------
* A :class:`Lease` ends ``seconds`` after its task was submitted (LMCache's lock was taken a
  moment before that, on the same thread; the default leases leave 30 s and 60 s of margin).
* A store publishes its file only if the lease still held once every byte of the payload had
  been read (hashed and written): the check is the last step before the rename, so an expired
  lease leaves no file, only a miss.  A store whose lease has ended before it starts reads
  nothing.
* A load reads a file only while its lease holds; one that finds it ended is a miss.  A read
  already in the kernel when the lease ends can still complete into the buffer: a read that
  takes longer than the margin (a device that hangs for a minute) is the one case no check
  here covers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: Below LMCache's default read-lock TTL (300 s), which guards a store's object.
STORE_LEASE_S = 270.0
#: Below LMCache's default write-lock TTL (600 s), which guards a load's staging object.
LOAD_LEASE_S = 540.0

Clock = Callable[[], float]


class LeaseExpired(Exception):
    """The task's lease ended before its file was published (a store) or read (a load)."""


@dataclass(frozen=True)
class Lease:
    """Until when (``clock`` seconds) a task may touch the buffers it was given."""

    until: float
    clock: Clock = field(default=time.monotonic, compare=False)

    @classmethod
    def starting_now(cls, seconds: float, clock: Clock = time.monotonic) -> Lease:
        return cls(clock() + seconds, clock)

    def expired(self) -> bool:
        return self.clock() >= self.until

    def check(self) -> None:
        """Raise :class:`LeaseExpired` once the lease has ended."""
        if self.expired():
            raise LeaseExpired(f"the task's L1 lease ended {self.clock() - self.until:.1f}s ago")
