"""A CPU engine's KV mapping released from the server once the engine is gone.

LMCache 0.5.6 maps a CPU engine's KV segment (``/dev/shm/lmcache_kv_<pid>_<n>``) once per layer
when the engine registers, and never unmaps it: ``CpuShmTensorWrapper.to_tensor`` pins each
mapping's base buffer in a module-level dict (``_CPU_SHM_KEEP_ALIVE``) keyed by the very
storage that buffer keeps alive, so the storage's finalizer, the ``munmap``, can never run.
Unregistering or reaping an engine drops LMCache's context and nothing more.  Found by the
traffic run (issue 49): every vLLM restart left its whole KV cache (``VLLM_CPU_KVCACHE_SPACE``)
resident in the server, and its segment undeletable by the sweep, which spares mapped ones.

:func:`install` changes two things in the server process:

* ``to_tensor`` drops the pin as soon as it returns: ``torch.frombuffer`` already ties the
  buffer to the storage, and LMCache's finalizer unmaps when the last view is gone.
* Before an engine registers, and before each of LMCache's reaper passes, every registered
  engine whose process is gone is unregistered (LMCache's own ``unregister_kv_cache``): an
  engine killed before its unregister reached the server (SIGKILL; vLLM kills its workers 5 s
  into a shutdown) is released when the next one registers, not after the reaper's grace (an
  hour for an engine that never pinged).

Invariants
----------
* A mapping is unmapped only once no tensor view of it exists (LMCache's finalizer; kvpersist
  keeps none): a retrieve in flight holds its context and so its views.
* An engine is released early only when its process was *watchable* at registration: its pid
  (from its segment names) was visible here, in this process's pid namespace, with a start time
  recorded.  It is gone when that pid no longer exists or has another start time (reused).
  An engine in another pid namespace (another container) is never judged: LMCache's reaper
  handles it, now with the memory actually returned.
* Installed only when feature ``engine_release`` of :mod:`.pins` matches the installed LMCache.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..pidfile import process_start_ticks
from ..shm_sweep import SEGMENT_NAME
from . import pins
from .wrapping import wrap_method

FEATURE = "engine_release"

logger = logging.getLogger("kvpersist.engine_release")


def _unpinning(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def to_tensor(self: Any) -> Any:
        from lmcache.v1.platform.devices.cpu import shm

        out = original(self)
        shm._CPU_SHM_KEEP_ALIVE.pop(id(out.untyped_storage()), None)  # absent for an empty view
        return out

    return to_tensor


def _pid_namespace(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def engine_process(segment_names: Iterable[str]) -> tuple[int, int] | None:
    """(pid, start time) of the process owning the segments, when every name carries the same
    pid and that process is visible in this pid namespace; None otherwise."""
    pids = set()
    for name in segment_names:
        match = SEGMENT_NAME.match(str(name).lstrip("/"))
        if match is None:
            return None
        pids.add(int(match.group("pid")))
    if len(pids) != 1:
        return None
    (pid,) = pids
    namespace = _pid_namespace(pid)
    if namespace is None or namespace != _pid_namespace("self"):
        return None
    ticks = process_start_ticks(pid)
    return None if ticks is None else (pid, ticks)


class EngineWatch:
    """The watchable engines registered in this server, by LMCache instance id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, tuple[int, int]] = {}

    def registered(self, instance_id: int, kv_caches: Any) -> None:
        names = [getattr(w, "shm_name", None) for w in _wrappers(kv_caches)]
        owner = engine_process(n for n in names if n) if names and all(names) else None
        with self._lock:
            if owner is None:
                self._owners.pop(instance_id, None)
            else:
                self._owners[instance_id] = owner

    def gone(self) -> list[int]:
        """Instance ids whose process no longer runs (forgotten here once returned)."""
        with self._lock:
            dead = [iid for iid, (pid, ticks) in self._owners.items()
                    if process_start_ticks(pid) != ticks]
            for iid in dead:
                del self._owners[iid]
        return dead


def _wrappers(kv_caches: Any) -> list[Any]:
    """The tensor wrappers of a registration (a list, or a dict of lists, of wrappers)."""
    if isinstance(kv_caches, dict):
        return [w for v in kv_caches.values() for w in _wrappers(v)]
    if isinstance(kv_caches, list | tuple):
        return [w for v in kv_caches for w in _wrappers(v)]
    return [kv_caches]


def release_gone(module: Any, watch: EngineWatch) -> list[int]:
    """Unregister (LMCache's own method) every engine of ``module`` whose process is gone."""
    released = []
    for iid in watch.gone():
        with module._lock:
            known = iid in module._cache_contexts
        if known:
            logger.info("kvpersist: engine %d's process is gone; releasing its KV mapping", iid)
            module.unregister_kv_cache(iid)
            released.append(iid)
    return released


def _registering(original: Callable[..., Any], watch: EngineWatch) -> Callable[..., Any]:
    def register_kv_cache(self: Any, instance_id: int, kv_caches: Any, *args: Any,
                          **kwargs: Any) -> Any:
        release_gone(self, watch)
        result = original(self, instance_id, kv_caches, *args, **kwargs)
        watch.registered(instance_id, kv_caches)
        return result

    return register_kv_cache


def _reaping(original: Callable[..., Any], watch: EngineWatch) -> Callable[..., Any]:
    def reap_stale_instances(self: Any, *args: Any, **kwargs: Any) -> Any:
        released = release_gone(self, watch)
        reaped = original(self, *args, **kwargs)
        return [*released, *reaped]

    return reap_stale_instances


def install() -> EngineWatch | None:
    """Install both changes in this (server) process; None (nothing installed, one line logged
    by :func:`.pins.available`) when LMCache's pinned functions changed."""
    if not pins.available(FEATURE):
        return None
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ld
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    watch = EngineWatch()
    wrap_method(CpuShmTensorWrapper, "to_tensor", _unpinning)
    wrap_method(ld.LMCacheDrivenTransferModule, "register_kv_cache",
          lambda orig: _registering(orig, watch))
    wrap_method(ld.LMCacheDrivenTransferModule, "reap_stale_instances",
          lambda orig: _reaping(orig, watch))
    return watch
