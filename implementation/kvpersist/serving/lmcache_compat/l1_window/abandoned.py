"""4. An abandoned lookup is released when its load finishes, by one thread for all of them.

LMCache's ``LookupModule.free_lookup_locks`` of a lookup whose prefetch still runs would leave
its L1 buffers held until the read-lock TTL (300 s).  The release is deferred until the
prefetch publishes its result instead.

Invariants
----------
* One settler thread serves every abandoned lookup of the process, however many are waiting:
  during a storage stall, exactly when lookups are abandoned, the thread count stays flat.  It
  exits when nothing waits and starts again with the next one.
* Each waiting lookup is settled (``settle`` called) exactly once, after its prefetch finished,
  in the order the settler finds them finished; one still unfinished after ``max_wait_s`` is
  dropped with a log line (its buffers then fall to LMCache's TTL, as without kvpersist).
* A ``settle`` that raises is logged and does not stop the settler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvpersist.l1_window")

Clock = Callable[[], float]


@dataclass
class _Waiting:
    request_id: str
    finished: Callable[[], bool]
    settle: Callable[[], None]
    give_up_at: float


class AbandonedLookups:
    """The lookups given up while their prefetch ran (see the module docstring)."""

    def __init__(self, *, poll_s: float = 0.05, max_wait_s: float = 900.0,
                 clock: Clock = time.monotonic) -> None:
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def add(self, request_id: str, finished: Callable[[], bool],
            settle: Callable[[], None]) -> None:
        """Call ``settle`` once ``finished()`` is true (``finished`` must not block)."""
        with self._lock:
            self._waiting.append(_Waiting(request_id, finished, settle,
                                          self._clock() + self.max_wait_s))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvp-release-abandoned",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._thread = None
                    return
                waiting = list(self._waiting)
            done = {id(w) for w in waiting if self._settled(w)}
            if done:
                with self._lock:
                    self._waiting = [w for w in self._waiting if id(w) not in done]
            time.sleep(self.poll_s)

    def _settled(self, waiting: _Waiting) -> bool:
        """Whether ``waiting`` leaves the list now (settled, failed, or given up)."""
        try:
            if waiting.finished():
                waiting.settle()
                return True
        except Exception:
            logger.exception("kvpersist: request %s: releasing the abandoned lookup failed",
                             waiting.request_id)
            return True
        if self._clock() > waiting.give_up_at:
            logger.error("kvpersist: request %s: the abandoned lookup's load did not finish in "
                         "%.0f s; its L1 buffers are left to LMCache's lock TTL",
                         waiting.request_id, self.max_wait_s)
            return True
        return False


def release_when_done(abandoned: AbandonedLookups, module: Any, original: Callable[..., Any],
                      key: Any, tp_size: int, on_released: Callable[[str], None]) -> None:
    """``LookupModule.free_lookup_locks`` (``original``) for a lookup whose prefetch may still
    run: at once when it finished (or there is none), else when it finishes."""
    with module._prefetch_job_lock:
        job = module._prefetch_jobs.get(key.request_id)
    sm = module._ctx.storage_manager
    if job is None or sm.wait_prefetch_status(job.handle, 0):
        original(module, key, tp_size)
        return

    def settle() -> None:
        original(module, key, tp_size)
        on_released(key.request_id)
        logger.info("kvpersist: request %s: the abandoned lookup's L1 buffers were released "
                    "when its load finished", key.request_id)

    abandoned.add(key.request_id, lambda: bool(sm.wait_prefetch_status(job.handle, 0)), settle)
