"""The private state of LMCache's L1 that the L1 window's on-demand eviction reads (feature
``l1_window`` of :mod:`.pins`): the LRU order of an L1 manager's eviction policy and the
manager's objects.

Invariants
----------
* Every read goes through :func:`.adapters.require`: an
  attribute that is gone raises :class:`~.adapters.CompatError` naming it, never a default that
  would silently change which objects are evicted.  The constructors that set these attributes
  are pinned, so a renamed one turns the window off at start, before any read.
* Eviction on demand follows LMCache's LRU policy only: :func:`lru_order` is None for an L1
  whose eviction policy is another kind (the restore then takes what free L1 holds, as LMCache
  does), by its class, not by a missing attribute.
"""

from __future__ import annotations

from typing import Any

from .adapters import CompatError, require


def eviction_policy_of(storage_manager: Any, l1_manager: Any) -> Any:
    """The eviction policy of ``l1_manager``'s L1 eviction controller (CompatError if none)."""
    from lmcache.v1.distributed.storage_controllers.eviction_controller import (
        L1EvictionController,
    )

    for controller in require(storage_manager, "_eviction_controllers"):
        if (isinstance(controller, L1EvictionController)
                and require(controller, "_l1_manager") is l1_manager):
            return require(controller, "_eviction_policy")
    raise CompatError(f"LMCache's {type(storage_manager).__name__} has no L1 eviction "
                      "controller for this L1 manager (kvpersist was written against LMCache "
                      "0.5.6)")


def lru_order(storage_manager: Any, l1_manager: Any) -> list[Any] | None:
    """``l1_manager``'s object keys, least recently used first; None when its policy is not LRU."""
    from lmcache.v1.distributed.eviction_policy.lru import LRUEvictionPolicy

    policy = eviction_policy_of(storage_manager, l1_manager)
    if not isinstance(policy, LRUEvictionPolicy):
        return None
    with require(policy, "_lock"):
        return list(require(policy, "_order"))


def l1_objects(l1_manager: Any) -> dict[Any, Any]:
    """``l1_manager``'s objects by key (LMCache's own dict: read, never changed here)."""
    objects: dict[Any, Any] = require(l1_manager, "_objects")
    return objects
