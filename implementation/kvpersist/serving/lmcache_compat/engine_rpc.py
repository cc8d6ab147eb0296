"""Run-time weight changes seen where they enter the engine: vLLM's ``EngineCore.collective_rpc``.

Every way vLLM 0.32 offers to change a running engine's weights reaches the workers through the
engine core's ``collective_rpc`` utility: the ``/update_weights`` family and the weight-transfer
engine (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), ``reload_weights``, ``reset_weights``, ``update_config``, and any
callable an RLHF framework sends (``llm.collective_rpc(fn)``).  The engine's own steps do not
go through it (they call the executor directly).

Invariants
----------
* Closed world: a collective RPC whose method is not named in :data:`WEIGHT_NEUTRAL_RPCS` (a
  callable included, whatever it does) is a weight change.  The listeners hear of it *before*
  the RPC runs, on the engine core's thread, between two steps: no step computes with new
  weights before kvpersist knows.
* Installed once per process; :func:`watch_weight_changes` returns False when the method to
  wrap is not there (another vLLM), and the caller then closes the gate.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.kvpersist.connector")

#: Collective RPCs that leave the weights as they are (reads, health, profiling, caches).
WEIGHT_NEUTRAL_RPCS = frozenset({
    "check_health", "compute_weight_checksums", "get_kv_cache_spec", "get_model_inspection",
    "get_supported_tasks", "list_loras", "profile", "reset_encoder_cache", "reset_mm_cache",
    "save_sharded_state", "save_tensorized_model", "start_profile", "stop_profile",
})

_listeners: list[Callable[[str], None]] = []
_installed = False


def rpc_name(method: object) -> str:
    """The name a collective RPC is known by: the string, or a callable's qualified name."""
    if isinstance(method, str):
        return method
    return str(getattr(method, "__qualname__", None) or getattr(method, "__name__", None)
               or repr(method))


def _announce(method: object) -> None:
    name = rpc_name(method)
    if isinstance(method, str) and name in WEIGHT_NEUTRAL_RPCS:
        return
    for listener in list(_listeners):
        listener(name)


def watch_weight_changes(listener: Callable[[str], None]) -> bool:
    """Have ``listener(rpc name)`` called before every collective RPC that may change the
    weights (see module invariants); False when vLLM's engine core cannot be watched."""
    global _installed
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    original = getattr(EngineCore, "collective_rpc", None)
    if not callable(original):
        return False
    if not _installed:
        @functools.wraps(original)
        def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            _announce(method)
            return original(self, method, *args, **kwargs)

        EngineCore.collective_rpc = collective_rpc  # type: ignore[method-assign]
        _installed = True
    _listeners.append(listener)
    return True


def stop_watching(listener: Callable[[str], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)
