"""One-line progress display for long scans, scrubs and deletions (``kvp-admin`` on a terminal).

Invariants
----------
* Only ever writes to a terminal: :func:`stderr_progress` returns None when stderr is not a tty,
  so ``--json`` output, pipes and logs never contain progress text.
* At most one redraw per ``min_interval`` seconds, whatever the call rate; :meth:`Progress.close`
  erases the line so that what is printed next starts on a clean line.
* With a known total the line is a bar with percent, rate and time left; without one (a walk does
  not know how many files it will find) it shows the count and the rate.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    """Callable with the number of items done so far."""

    def __init__(self, label: str, total: int | None = None, *, unit: str = "files",
                 stream: TextIO | None = None, min_interval: float = 0.2) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.began = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self._drawn and now - self._last_draw < self.min_interval and done != self.total:
            return
        self._last_draw = now
        self._drawn = True
        self.stream.write("\r" + self.line(done, now - self.began) + "\x1b[K")
        self.stream.flush()

    def line(self, done: int, elapsed: float) -> str:
        rate = done / elapsed if elapsed > 0 else 0.0
        if not self.total:
            return f"{self.label}: {done:,} {self.unit} ({rate:,.0f}/s)"
        share = min(done / self.total, 1.0)
        filled = int(share * BAR_WIDTH)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f}s left" if left != float("inf") else "--"
        return (f"{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * share:5.1f}% "
                f"{done:,}/{self.total:,} {self.unit} ({rate:,.0f}/s, {eta})")

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


def stderr_progress(label: str, total: int | None = None, *, unit: str = "files") -> Progress | None:
    """A :class:`Progress` on stderr if it is a terminal, else None."""
    return Progress(label, total, unit=unit) if sys.stderr.isatty() else None
