"""Stores opened by a test, checked when it ends: the store tests end on
:meth:`KvFileStore.check` the way python-diskcache's tests end on ``Cache.check()``.

Invariant: :func:`open_checked_store` records every store it opens; :func:`check_and_close`
runs ``check(deep=True)`` on the last store opened on each root, closes it, and forgets them
all, so a test that leaves the index and the disk disagreeing fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..l2.store import KvFileStore

_OPENED: list[KvFileStore] = []


def open_checked_store(root: Path, capacity: int = 10**9, **kw: Any) -> KvFileStore:
    """A store on ``root`` opened with a synchronous scan, checked when the test ends."""
    store = KvFileStore(root, capacity, **kw)
    store.open(background_scan=False)
    _OPENED.append(store)
    return store


def track(store: KvFileStore) -> None:
    """Check ``store`` when the test ends (one a test opened by hand)."""
    _OPENED.append(store)


def untrack(store: KvFileStore) -> None:
    """Leave ``store`` unchecked (one the test has "killed": its state is the disk's now)."""
    _OPENED.remove(store)


def forget_opened() -> None:
    _OPENED.clear()


def check_and_close() -> None:
    """Assert that the last store opened on each root finds nothing wrong, then close it."""
    latest = {store.root: store for store in _OPENED}
    _OPENED.clear()
    for store in latest.values():
        problems = store.check(deep=True)
        store.close()
        assert problems == [], f"{store.root}: {problems}"
