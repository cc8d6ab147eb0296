"""The L1 window's reads of LMCache's L1 internals (:mod:`kvpersist.serving.lmcache_compat.l1_internals`):
the LRU order from LMCache's real policy, and a loud error, never a default, when an internal is
gone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from lmcache.v1.distributed.eviction_policy.lru import LRUEvictionPolicy
from lmcache.v1.distributed.storage_controllers.eviction_controller import L1EvictionController

from kvpersist.serving.lmcache_compat import l1_internals
from kvpersist.serving.lmcache_compat.adapters import CompatError


def controller_of(l1_manager: Any, policy: Any) -> Any:
    """An L1 eviction controller holding ``policy`` for ``l1_manager``, without its thread."""
    controller = object.__new__(L1EvictionController)
    controller._l1_manager = l1_manager
    controller._eviction_policy = policy
    return controller


def test_the_lru_order_is_lmcache_s_oldest_first() -> None:
    l1 = SimpleNamespace(_objects={"a": 1, "b": 2})
    policy = LRUEvictionPolicy()
    policy.on_keys_created(["a", "b", "c"])
    policy.on_keys_touched(["a"])
    other_l1 = SimpleNamespace(_objects={})
    manager = SimpleNamespace(_eviction_controllers=[
        controller_of(other_l1, LRUEvictionPolicy()), controller_of(l1, policy)])
    # LMCache's order: a request's later chunks go first (its earlier ones keep the prefix)
    assert l1_internals.lru_order(manager, l1) == ["c", "b", "a"]
    assert l1_internals.l1_objects(l1) == {"a": 1, "b": 2}


def test_another_policy_means_no_eviction_on_demand() -> None:
    l1 = SimpleNamespace(_objects={})
    manager = SimpleNamespace(_eviction_controllers=[controller_of(l1, SimpleNamespace())])
    assert l1_internals.lru_order(manager, l1) is None


@pytest.mark.parametrize("gone", ["_eviction_controllers", "_l1_manager", "_order", "_objects"])
def test_a_renamed_internal_is_an_error_naming_it(gone: str) -> None:
    l1 = SimpleNamespace(_objects={})
    policy = LRUEvictionPolicy()
    controller = controller_of(l1, policy)
    manager = SimpleNamespace(_eviction_controllers=[controller])
    owner = {"_eviction_controllers": manager, "_l1_manager": controller, "_order": policy,
             "_objects": l1}[gone]
    delattr(owner, gone)
    with pytest.raises(CompatError, match=gone):
        l1_internals.lru_order(manager, l1)
        l1_internals.l1_objects(l1)


def test_an_l1_without_an_eviction_controller_is_an_error() -> None:
    manager = SimpleNamespace(_eviction_controllers=[])
    with pytest.raises(CompatError, match="no L1 eviction controller"):
        l1_internals.lru_order(manager, SimpleNamespace(_objects={}))
