"""Diagnostic only (benchmarks, never the product): vLLM's message queues without their busy poll.

vLLM's shared-memory message queue (``vllm.distributed.device_communicators.shm_broadcast``)
lets a reader spin on ``sched_yield`` for ``SpinCondition``'s ``busy_loop_s`` (1 s) after every
message before it sleeps on a socket.  On a 2-core host that spin holds a core the cache server
could use while vLLM waits for a restore.  Put this folder on ``PYTHONPATH`` of vLLM's processes
and that module is patched as it is imported: ``busy_loop_s`` defaults to 0, so a reader with
nothing to read sleeps on its socket at once.  Nothing else changes.

Used by ``benchmarks/restore_cpu_accounting.py --variant PYTHONPATH=<this folder>`` to show how
much of a restore's time is the CPU the spin takes.  The product never does this: vLLM's recipe
stays as its operator wrote it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PATCHED_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then sets ``SpinCondition``'s ``busy_loop_s`` default to 0."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._real.exec_module(module)
        init = module.SpinCondition.__init__
        if init.__defaults__ != (1,):  # another vLLM: refuse rather than patch blindly
            raise RuntimeError(f"vllm_without_spin: unexpected SpinCondition defaults "
                               f"{init.__defaults__!r}")
        init.__defaults__ = (0,)
        print("vllm_without_spin: SpinCondition busy_loop_s=0", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PATCHED_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)  # type: ignore[attr-defined]
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
