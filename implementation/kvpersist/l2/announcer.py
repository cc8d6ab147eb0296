"""The index's changes passed to LMCache's byte accounting on one thread, in order, so that no
store waits for them.

A restart of a full tier re-announces every file (a million keys on a 1.5 TB tier).  Making
LMCache's ``ObjectKey`` for each costs about 4 µs, seconds in all, and stores used to wait for
it: the index was marked complete only after the announcement returned.  Here the store's
callbacks only enqueue; one thread makes the keys and calls LMCache.

Invariants
----------
* Every batch handed to :meth:`Announcer.announce` is delivered exactly once, in the order
  handed over, whatever its kind (a queue with one consumer; a large batch goes in slices of
  :data:`BATCH` keys, in order): the scan's batch, oldest access first, reaches LMCache before
  any store, read or deletion made after it, so LMCache's LRU order is the index's, and a
  key's removal or access never overtakes its addition when they were handed over in that
  order.
* LMCache's view may lag the index, never the other way: the capacity is enforced by the
  store's own index (:mod:`kvpersist.l2.index`), so a lagging usage figure delays LMCache's
  eviction, and never lets the tier exceed its cap.
* A delivery that raises is logged and dropped; the thread goes on with the next batch.
* :meth:`Announcer.close` delivers everything handed over before it, then stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger("kvpersist.l2")

#: Delivers one batch of one kind: (keys, their sizes, or None for a kind without sizes).
Deliver = Callable[[list[Any], "list[int] | None"], None]

#: Keys converted and delivered per call, so that a million-key batch lets other threads run
#: between calls and LMCache's usage grows as it goes.
BATCH = 65536

#: One hand-over: (kind, keys, sizes or None).
_Batch = tuple[str, Sequence[Any], "Sequence[int] | None"]


class Announcer:
    """The ordered delivery thread (see module invariants); ``deliver`` maps each kind of
    change (``"stored"``, ``"deleted"``, ``"accessed"``, ...) to what delivers a batch."""

    def __init__(self, deliver: Mapping[str, Deliver], *, name: str = "kvpersist-l2-announce",
                 batch: int = BATCH) -> None:
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        self._deliver = dict(deliver)
        self._batch = batch
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._handed = 0
        self._delivered = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def announce(self, kind: str, keys: Sequence[Any], sizes: Sequence[int] | None = None
                 ) -> None:
        """Hand over one batch of ``kind``; returns at once (the keys are not copied: the
        caller hands them over and does not change them)."""
        if kind not in self._deliver:
            raise ValueError(f"unknown kind of announcement {kind!r}; known: "
                             f"{sorted(self._deliver)}")
        if sizes is not None and len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if not keys:
            return
        with self._idle:
            self._handed += 1
        self._queue.put((kind, keys, sizes))

    @property
    def pending(self) -> int:
        """Batches handed over and not yet delivered."""
        with self._idle:
            return self._handed - self._delivered

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every batch handed over so far is delivered; False on timeout."""
        with self._idle:
            target = self._handed
            return self._idle.wait_for(lambda: self._delivered >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Deliver what was handed over, then stop the thread (see module invariants)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("kvpersist L2: %d announcements to LMCache still pending at close",
                           self.pending)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                return
            kind, keys, sizes = item
            for start in range(0, len(keys), self._batch):
                part = list(keys[start:start + self._batch])
                try:
                    self._deliver[kind](
                        part, None if sizes is None else list(sizes[start:start + self._batch]))
                except Exception:
                    logger.exception("kvpersist L2: announcing %d %s keys to LMCache failed",
                                     len(part), kind)
            with self._idle:
                self._delivered += 1
                self._idle.notify_all()
