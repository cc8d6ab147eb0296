"""A host made busy on purpose, as CI's second worker makes it: processes that spin on a core
each, for diagnostics that compare answers computed quietly and under load.

Invariant: every spinning process is stopped (terminated and joined) when the block exits,
whatever the block raised.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each, stopped on exit."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=5)
