"""Faults the tests inject into a real LMCache server, through the testing entry point
:mod:`kvpersist.testing.fault_server` (never through the production server's entry point, which
installs nothing a ``KVP_FAULT_*`` variable can trigger; this package is not in the wheel).

``KVP_FAULT_STOP_IN_RETRIEVE_S=N`` (tests only; never set by any launcher or config): a
retrieve the server handles, in either transfer mode, first stops the *whole* server process
for N seconds (SIGSTOP, continued by a helper process), then does its work; the other
ranks' retrieves of the same request do not stop it again.  Its heartbeat
answers stop with it, so a worker's heartbeat calls the server unhealthy while the transfer is
in flight, and the server writes afterwards: the busy-server race of a late write, made
deterministic.  Each stop appends ``<unix time> stop|go <pid>`` to
``KVP_FAULT_JOURNAL`` if set, so a test can order the server's writes against the worker's
reports.

``KVP_FAULT_STOP_IN_STORE_S=N`` (tests only): the first ``lmcache_driven`` store of the second
request the server stores stops the whole server process for N seconds before it reads vLLM's
KV blocks (once per process; the first request's stores go through, so two requests can be
running when it stops): a server that reads a store late, past every timeout and with its
heartbeat silent, made deterministic (the store fence's subject).  Journaled like the
retrieve stop.

``KVP_FAULT_STOP_IN_SECOND_STORE_S=N`` (tests only): the same stop at the first store of a
request the server has stored once already (once per process): the request's earlier store
settled and this one is in flight, the state in which LMCache 0.5.6 may already report the
request "finished sending" (the store fence's finished-request rule).  Journaled like the others; it
cannot be combined with ``KVP_FAULT_STOP_IN_STORE_S`` (both wrap the same handler).

``KVP_FAULT_HOLD_L2_LOADS_WHILE=PATH`` (tests only): every L2 load of kvpersist's adapter waits,
before it reads a file, while ``PATH`` exists (at most ``HOLD_MAX_S``).  Its L1 buffers are
reserved and nothing moves: the stalled load a connector gives up, made deterministic; removing
the file lets the loads finish.  Each hold logs a line to the server's stderr.

Invariants: without the variables nothing is changed; a malformed value stops the server at
start with a message (a test that thinks it injected a fault must not pass without it).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

STOP_IN_RETRIEVE = "KVP_FAULT_STOP_IN_RETRIEVE_S"
STOP_IN_STORE = "KVP_FAULT_STOP_IN_STORE_S"
STOP_IN_SECOND_STORE = "KVP_FAULT_STOP_IN_SECOND_STORE_S"
#: (module, class, method) of the server's read of a store out of vLLM's KV memory.
STORE_HANDLER = ("lmcache.v1.multiprocess.modules.lmcache_driven_transfer",
                 "LMCacheDrivenTransferModule", "store_with_chunk_mask")
HOLD_LOADS_WHILE = "KVP_FAULT_HOLD_L2_LOADS_WHILE"
HOLD_MAX_S = 600.0
#: (module, class, method) of the L2 load the hold delays: named, as the retrieve handlers are,
#: since the server's adapter is loaded by LMCache's config, not imported by serving.
HELD_LOAD = ("kvpersist.l2.adapter", "KvPersistL2Adapter", "_run_load")
JOURNAL = "KVP_FAULT_JOURNAL"
#: (module, class, method) of every handler that writes restored KV or hands it out.
RETRIEVE_HANDLERS = (
    ("lmcache.v1.multiprocess.modules.lmcache_driven_transfer", "LMCacheDrivenTransferModule",
     "retrieve"),
    ("lmcache.v1.multiprocess.modules.engine_driven_transfer", "EngineDrivenTransferModule",
     "prepare_retrieve"),
)


def stop_seconds(environ: Mapping[str, str], variable: str = STOP_IN_RETRIEVE) -> float | None:
    """The stop ``variable`` configures, or None; ValueError names a malformed value."""
    text = environ.get(variable, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not a number of seconds") from None
    if not 0 < seconds <= 600:
        raise ValueError(f"{variable}={text!r} must be in (0, 600] seconds")
    return seconds


def _journal(event: str) -> None:
    path = os.environ.get(JOURNAL)
    if path:
        with Path(path).open("a") as out:
            out.write(f"{time.time():.6f} {event} {os.getpid()}\n")


def journal_events(path: Path) -> list[str]:
    """The events of a fault journal (``stop``, ``go``) in order; none before it exists (a line
    still being appended, without its event yet, is not one)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [fields[1] for fields in map(str.split, text.splitlines()) if len(fields) > 1]


def stop_process(seconds: float) -> None:
    """Stop this process for ``seconds``: a detached helper sends SIGCONT afterwards."""
    pid = os.getpid()
    subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds}; kill -CONT {pid}"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    _journal("stop")
    # Directed at this thread, the stop takes effect before this thread runs on (a signal to
    # the process may be taken by another thread while this one goes on for a moment); it
    # stops every thread of the process all the same.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    _journal("go")


class _Stopper:
    """One stop per request: the other ranks' retrieves of a request that stopped the server
    (queued behind it) go on at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._stopped: set[str] = set()

    def __call__(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._stopped:
                return
            self._stopped.add(request_id)
            stop_process(self.seconds)


class _SecondRequestStopper:
    """Stops once, at the first call for the second distinct request id."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._seen: list[str] = []
        self._done = False

    def __call__(self, request_id: str) -> None:
        with self._lock:
            if self._done or request_id in self._seen:
                return
            self._seen.append(request_id)
            if len(self._seen) < 2:
                return
            self._done = True
        stop_process(self.seconds)


class _RepeatedRequestStopper:
    """Stops once, at the first call for a request id already seen in an earlier call."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._done = False

    def __call__(self, request_id: str) -> None:
        with self._lock:
            if self._done:
                return
            if request_id not in self._seen:
                self._seen.add(request_id)
                return
            self._done = True
        stop_process(self.seconds)


def _stopping(handler: Callable[..., Any], stop: Callable[[str], None]) -> Callable[..., Any]:
    @functools.wraps(handler)  # keeps LMCache's handler registration attributes
    def stopped_first(module: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        stop(str(getattr(key, "request_id", key)))
        return handler(module, key, *args, **kwargs)

    return stopped_first


def hold_path(environ: Mapping[str, str]) -> Path | None:
    """The configured hold file, or None; ValueError names a relative path."""
    text = environ.get(HOLD_LOADS_WHILE, "").strip()
    if not text:
        return None
    path = Path(text)
    if not path.is_absolute():
        raise ValueError(f"{HOLD_LOADS_WHILE}={text!r} must be an absolute path")
    return path


def _holding(run_load: Callable[..., Any], path: Path) -> Callable[..., Any]:
    @functools.wraps(run_load)
    def held_first(adapter: Any, tid: Any, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + HOLD_MAX_S
        if path.exists():
            print(f"kvpersist: FAULT INJECTION: L2 load {tid} held while {path} exists",
                  file=sys.stderr, flush=True)
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return run_load(adapter, tid, *args, **kwargs)

    return held_first


def install(environ: Mapping[str, str] | None = None) -> float | None:
    """Install the configured faults in this (server) process; returns the stop, if any."""
    env = os.environ if environ is None else environ
    seconds = stop_seconds(env)
    store_stop = stop_seconds(env, STOP_IN_STORE)
    second_store_stop = stop_seconds(env, STOP_IN_SECOND_STORE)
    hold = hold_path(env)
    if store_stop is not None and second_store_stop is not None:
        raise ValueError(f"{STOP_IN_STORE} and {STOP_IN_SECOND_STORE} stop the same handler: "
                         "set one of them")
    if store_stop is not None or second_store_stop is not None:
        import importlib

        module_name, class_name, method = STORE_HANDLER
        cls = getattr(importlib.import_module(module_name), class_name)
        if store_stop is not None:
            stopper: Callable[[str], None] = _SecondRequestStopper(store_stop)
            what = f"{STOP_IN_STORE}={store_stop:g}): the second request's first store"
        else:
            assert second_store_stop is not None
            stopper = _RepeatedRequestStopper(second_store_stop)
            what = (f"{STOP_IN_SECOND_STORE}={second_store_stop:g}): the first store of a "
                    "request stored once already")
        setattr(cls, method, _stopping(getattr(cls, method), stopper))
        print(f"kvpersist: FAULT INJECTION ({what} stops the server before it reads vLLM's KV "
              "blocks; for tests only", file=sys.stderr, flush=True)
    if hold is not None:
        import importlib

        module_name, class_name, method = HELD_LOAD
        cls = getattr(importlib.import_module(module_name), class_name)
        setattr(cls, method, _holding(getattr(cls, method), hold))
        print(f"kvpersist: FAULT INJECTION ({HOLD_LOADS_WHILE}={hold}): L2 loads wait while "
              "that file exists; for tests only", file=sys.stderr, flush=True)
    if seconds is None:
        return None
    import importlib

    stop = _Stopper(seconds)
    for module_name, class_name, method in RETRIEVE_HANDLERS:
        cls = getattr(importlib.import_module(module_name), class_name)
        setattr(cls, method, _stopping(getattr(cls, method), stop))
    print(f"kvpersist: FAULT INJECTION ({STOP_IN_RETRIEVE}={seconds:g}): every retrieve stops "
          "the server first; for tests only", file=sys.stderr, flush=True)
    return seconds
