"""Test-only: a worker's step sees each store it sent answered, unless the server stopped.

LMCache 0.5.6 records a store as settled only in a ``get_finished`` call that finds its future
answered, and keeps one store future per request: a request's next store replaces the last.
Whether a request's first store is recorded before its second is sent is therefore a race
between the server's read of that store and the engine's steps.  The finished-request store
fence test (``tests/e2e/test_store_fence_e2e.py``) needs the record made; on a loaded host the
engine's steps outran the server's read and the state under test never arose.

Installed in vLLM's worker process (from a test's ``sitecustomize``), the hook makes every
``get_finished`` of LMCache's worker adapter wait first until each store in flight is answered,
or until the fault journal shows the server stopped (a ``stop`` line not yet followed by a
``go``: see :mod:`kvpersist.testing.fault_injection`), or ``MAX_WAIT_S`` passed.  It changes
when LMCache looks, never what it finds: the futures, their results and every fence above are
untouched.

Invariants
----------
* Never waits while the journal shows the server stopped, so a stopped server's store stays in
  flight exactly as it would without the hook.
* Waits at most ``MAX_WAIT_S`` per call: a store never answered cannot hang the engine.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..serving.lmcache_compat import adapters as lmcache_adapters
from .fault_injection import journal_events

#: The longest one ``get_finished`` call waits for the stores in flight.
MAX_WAIT_S = 30.0
POLL_S = 0.01


def server_stopped(journal: Path) -> bool:
    """Whether the fault journal's last stop has no ``go`` after it yet."""
    events = journal_events(journal)
    return events.count("stop") > events.count("go")


def wait_for_stores(adapter: Any, journal: Path, *, max_wait_s: float = MAX_WAIT_S,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait until every store future of ``adapter`` is answered; False where the wait ended
    early because the server stopped or ``max_wait_s`` passed."""
    deadline = clock() + max_wait_s
    while True:
        pending = [f for f in lmcache_adapters.store_futures(adapter).values()
                   if not lmcache_adapters.future_settled(f)]
        if not pending:
            return True
        if server_stopped(journal) or clock() >= deadline:
            return False
        sleep(POLL_S)


def install(journal: Path) -> None:
    """Make each worker adapter's ``get_finished`` wait for its stores first, as kvpersist's
    store fence is installed on it (beneath the fence: the fence still sees every store future
    LMCache holds).  Imports only the fence's module, which a ``sitecustomize`` may import
    before vLLM sets itself up (the connector's other modules pull in libraries that vLLM's
    CPU kernel registration trips over when they are loaded that early)."""
    from kvpersist.serving.connector.worker import store_fence

    original = store_fence.StoreFence.install

    @functools.wraps(original)
    def install_settling_first(fence: store_fence.StoreFence) -> None:
        adapter = fence._adapter  # test-only: the adapter the fence is about to wrap
        for name in lmcache_adapters.FINISHED_METHODS:
            method = getattr(adapter, name, None)
            if method is not None:
                setattr(adapter, name, functools.partial(_wait_then, method, adapter, journal))
        original(fence)

    store_fence.StoreFence.install = install_settling_first  # type: ignore[method-assign,assignment]


def _wait_then(method: Callable[..., Any], adapter: Any, journal: Path, *args: Any,
               **kwargs: Any) -> Any:
    wait_for_stores(adapter, journal)
    return method(*args, **kwargs)
