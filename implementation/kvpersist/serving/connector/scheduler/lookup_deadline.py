"""When a pending cache lookup is abandoned: a stalled server is bypassed, a long load that
progresses is waited for.  Pure logic plus a small progress probe; no vLLM import.

A lookup on the LMCache server includes loading the prefix from L2 into L1, so its duration
grows with the bytes to restore (a 1M-token chat is tens of GB).  A fixed deadline throws those
restores away exactly when they matter; no deadline lets a hung server hold requests forever.

Invariants
----------
* A lookup is abandoned (the request is recomputed) as soon as one of these holds:
  - nobody listens at the server's socket (``gone``: a killed server), at once;
  - the connector's heartbeat has said the server is unhealthy for ``dead_after_s`` seconds
    without a break, and no progress was seen in that time (the liveness rule of
    :mod:`kvpersist.serving.connector.worker.transfer_wait`: a server busy loading gigabytes,
    or starved of CPU by its engine's workers, misses 2 s beats; a missed beat is not a death);
  - ``stall_s`` seconds passed since the later of its start and the server's last progress;
  - ``max_s`` seconds passed since its start (a ceiling, whatever the progress).
* Progress is any change of the server's load counters (:func:`progress_token`: bytes the L2
  adapters read or loaded, L1 bytes in use or staged, completed prefetches), polled by
  :class:`ServerProgressProbe` every ``interval_s`` while lookups are pending, off the
  scheduler's thread.  It is server-wide: another request's load counts, since a server that
  moves any load is not stalled.
* A poll the server does not answer in time is no look: the server's progress is unknown, not
  nil.  A server starved of CPU by its engine's polling processes answers ``/status`` late
  while its readers keep reading (seen in a clean-clone CI run: "no progress for 5.0s" while the
  server had read 81 MiB in the restore's 20 s); the stall rule judges only what answers showed.
  A server that answers nothing for ``blind_s`` seconds is judged up to now again, and a dead
  one is the heartbeat's and the socket's business.
* With a probe, "no progress" and "unhealthy without progress" are measured up to the probe's
  latest look, not up to now: a vLLM process that was itself stalled (CPU starvation, page
  faults after a page-cache drop, a GIL held for seconds) cannot look, and its own pause is not
  the server's.  Seen on 2 cores: the probe's thread was held 5 s while the server kept reading,
  and the restore was thrown away.  Should the probe not look for ``blind_s`` seconds, now is
  used again, so a lookup is never waited for unbounded by a probe that stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import http
from ...lmcache_compat.status import progress_token

Clock = Callable[[], float]


@dataclass(frozen=True)
class Verdict:
    """An abandoned lookup: ``reason`` is a metric label (server_down, stalled, too_long),
    ``text`` the log's words."""

    reason: str
    text: str

    def __str__(self) -> str:
        return self.text


class LookupDeadline:
    """Per-request bookkeeping of pending lookups (see module invariants)."""

    def __init__(self, stall_s: float, max_s: float, clock: Clock = time.monotonic,
                 dead_after_s: float = 5.0, blind_s: float = 30.0) -> None:
        self.stall_s = stall_s
        self.max_s = max_s
        self.dead_after_s = dead_after_s
        self.blind_s = blind_s
        self._clock = clock
        self._began: dict[str, float] = {}
        self._progress_at = float("-inf")
        self._unhealthy_since: float | None = None
        self._looked_at: float | None = None  # None: no probe watches, judge up to now
        self._lock = threading.Lock()

    def begin(self, rid: str) -> float:
        """Start (or continue) the wait of ``rid``; returns when it began."""
        with self._lock:
            return self._began.setdefault(rid, self._clock())

    def end(self, rid: str) -> None:
        with self._lock:
            self._began.pop(rid, None)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._began)

    def progressed(self) -> None:
        """The server's load counters moved (called by the probe)."""
        with self._lock:
            self._progress_at = self._clock()

    def looked(self) -> None:
        """The probe saw the server's counters (an answered poll), or had nothing to look for;
        from the first call on, stalls are judged up to the latest look."""
        with self._lock:
            self._looked_at = self._clock()

    def _judged_at(self, now: float) -> float:
        looked = self._looked_at
        if looked is None or now - looked > self.blind_s:
            return now
        return looked

    def verdict(self, rid: str, *, healthy: bool, gone: bool = False) -> Verdict | None:
        """Why ``rid``'s lookup is abandoned now, or None to keep waiting.  ``gone``: nobody
        listens at the server's socket."""
        with self._lock:
            now = self._clock()
            if healthy:
                self._unhealthy_since = None
            elif self._unhealthy_since is None:
                self._unhealthy_since = now
            began = self._began.get(rid)
            if began is None:
                return None
            if gone:
                return Verdict("server_down", "nobody listens at the server's socket "
                                              f"after {now - began:.1f}s")
            judged = self._judged_at(now)
            if (self._unhealthy_since is not None
                    and now - self._unhealthy_since >= self.dead_after_s
                    and judged - self._progress_at > self.dead_after_s):
                return Verdict("server_down", f"server unhealthy for "
                                              f"{now - self._unhealthy_since:.1f}s without "
                                              f"progress, after {now - began:.1f}s")
            if now - began > self.max_s:
                return Verdict("too_long", f"still loading after {now - began:.1f}s "
                                           f"(limit {self.max_s:.0f}s)")
            quiet = judged - max(began, self._progress_at)
            if quiet > self.stall_s:
                return Verdict("stalled", f"no progress for {quiet:.1f}s (server stalled)")
            return None


class ServerProgressProbe:
    """Polls the server's ``/status`` while lookups are pending and reports progress to a
    :class:`LookupDeadline`.  A daemon thread; every request it makes has a timeout."""

    def __init__(self, status_url: str, deadline: LookupDeadline, *, interval_s: float = 0.5,
                 timeout_s: float = 2.0,
                 fetch: Callable[[str, float], Mapping[str, Any] | None] | None = None) -> None:
        self.status_url = status_url
        self.deadline = deadline
        self.interval_s = interval_s
        # A server busy restoring answers /status slowly (seen under CI load: a 0.5 s limit
        # missed every answer and a progressing restore was taken for a stall).
        self.timeout_s = timeout_s
        self._fetch = fetch or _fetch_status
        self._last: tuple[float, ...] | None = None
        self.polls = 0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpersist-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.deadline.looked()
        while not self._stop.wait(self.interval_s):
            if self.deadline.pending == 0:
                self._last = None  # the next wait starts from a fresh reading
                self.deadline.looked()
                continue
            self.polls += 1
            status = self._fetch(self.status_url, self.timeout_s)
            if status is None:
                continue  # no answer: no look (see module invariants)
            self.answers += 1
            token = progress_token(status)
            if self._last is not None and token != self._last:
                self.deadline.progressed()
            self._last = token
            self.deadline.looked()

    def describe(self) -> str:
        """For the bypass log line: what the probe saw."""
        return f"progress probe: {self.answers}/{self.polls} polls answered, last {self._last}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _fetch_status(url: str, timeout: float) -> Mapping[str, Any] | None:
    return http.get_object(url, timeout=timeout)
