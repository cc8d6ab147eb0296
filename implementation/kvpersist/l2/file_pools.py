"""One pool of file threads per root, and tasks that finish when their last file does.

The adapter's load and store tasks read or write many files at once.  Before, every file of
every root went through one shared pool, and each task held a task thread while it waited for
its files: a device that stopped answering (reads stuck in the kernel, which no signal ends)
took the shared file threads, then every task thread, and so the whole tier with it.

Invariants
----------
* A file operation runs on the pool of the root that holds its key, so a device that stops
  answering holds only its own root's threads; the other roots' files, and new tasks, go on.
* No thread waits for a file: a task's ``done`` runs once, on the thread of its last file to
  finish, with every file's result in submission order (None where the call raised, logged).
* A task with a file that never returns never finishes, and keeps the buffers its calls write
  into: giving a read up while it may still write into LMCache's memory object could corrupt
  whatever that buffer holds next.  LMCache holds them for it only until its lock's TTL
  lapses; the adapter's calls check their lease (:mod:`kvpersist.l2.lease`) before they
  touch a buffer, which covers every call but one already in the kernel at that moment.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

logger = logging.getLogger("kvpersist.l2")

_T = TypeVar("_T")


class _Gather(Generic[_T]):
    """The results of one task's files, and its ``done`` called by the last to finish."""

    def __init__(self, label: str, count: int, done: Callable[[list[_T | None]], None]) -> None:
        self._label = label
        self._results: list[_T | None] = [None] * count
        self._left = count
        self._lock = threading.Lock()
        self._done = done

    def finished(self, index: int, future: Future[_T] | None) -> None:
        """File ``index`` is done (``future`` None: it never ran, its result stays None)."""
        try:
            if future is not None:
                self._results[index] = future.result()
        except Exception:
            logger.exception("kvpersist L2 %s: file %d failed", self._label, index)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.complete()

    def complete(self) -> None:
        try:
            self._done(self._results)
        except Exception:  # a callback of a future must not raise: it would only be logged
            logger.exception("kvpersist L2 %s: finishing the task failed", self._label)


class FilePools:
    """``roots`` pools of ``threads_per_root`` file threads (see module invariants)."""

    def __init__(self, roots: int, threads_per_root: int,
                 name: str = "kvpersist-l2-file") -> None:
        if roots <= 0 or threads_per_root <= 0:
            raise ValueError("at least one root and one thread per root")
        self._pools = [ThreadPoolExecutor(max_workers=threads_per_root,
                                          thread_name_prefix=f"{name}-{i}")
                       for i in range(roots)]

    def run_all(self, label: str, calls: Sequence[tuple[int, Callable[[], _T]]],
                done: Callable[[list[_T | None]], None]) -> None:
        """Run each ``(root, call)`` on that root's pool; ``done(results)`` exactly once, when
        all have finished (at once for no call).  Returns without waiting and never raises."""
        gather: _Gather[_T] = _Gather(label, len(calls), done)
        if not calls:
            gather.complete()
            return
        for index, (root, call) in enumerate(calls):
            try:
                future = self._pools[root].submit(call)
            except Exception:  # shut down: that file fails, the task still finishes once
                logger.exception("kvpersist L2 %s: file %d not started", label, index)
                gather.finished(index, None)
                continue
            future.add_done_callback(functools.partial(gather.finished, index))

    def shutdown(self) -> None:
        """Wait for every file in flight (a hung device's with them)."""
        for pool in self._pools:
            pool.shutdown(wait=True, cancel_futures=False)
