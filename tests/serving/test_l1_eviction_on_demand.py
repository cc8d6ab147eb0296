"""Eviction on demand on LMCache's real L1 manager and LRU policy, in process: a reservation that
runs out of memory evicts clean objects, oldest first, and nothing that is not on L2.

The end-to-end test (``tests/e2e/test_l1_window_e2e.py``) shows a busy L1 giving way to a
restore through real processes, but there LMCache's own eviction thread, which wakes every
second, may free the busy chunks first on a loaded host; here nothing else evicts, so the rule
itself is what is measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
)
from lmcache.v1.distributed.eviction_policy.lru import LRUEvictionPolicy
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.storage_controllers.eviction_controller import L1EvictionController

from kvpersist.serving.lmcache_compat import l1_internals
from kvpersist.serving.lmcache_compat.l1_window import eviction
from kvpersist.serving.lmcache_compat.l1_window.state import WindowState, layout_bytes

OBJECT = MemoryLayoutDesc(shapes=[torch.Size([256, 1024])], dtypes=[torch.float32])  # 1 MiB
SLOTS = 3  # objects the L1 holds


def key(n: int) -> ObjectKey:
    return ObjectKey(chunk_hash=n.to_bytes(32, "big"), model_name="m", kv_rank=0,
                     object_group_id=0, cache_salt="")


class Setup:
    """A real L1 manager of ``SLOTS`` objects whose LRU policy hears its events, and the window
    state whose ``reserve_write`` wraps the manager's (as ``l1_window.install`` does)."""

    def __init__(self) -> None:
        size = SLOTS * layout_bytes(OBJECT)
        self.l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
            size_in_bytes=size, use_lazy=False)))
        # LMCache's own controller, as the server builds it; its thread is never started
        controller = L1EvictionController(self.l1, EvictionConfig(eviction_policy="LRU"))
        assert isinstance(controller._eviction_policy, LRUEvictionPolicy)
        self.state = WindowState(window_bytes=layout_bytes(OBJECT))
        self.state.storage_manager = SimpleNamespace(_eviction_controllers=[controller])
        self.original = self.l1.reserve_write

    def write(self, *numbers: int) -> dict[Any, Any]:
        keys = [key(n) for n in numbers]
        results = eviction.reserve_write(self.state, self.l1, self.original, keys,
                                         [False] * len(keys), OBJECT)
        written = [k for k in keys if results[k][0].name == "SUCCESS"]
        if written:
            self.l1.finish_write(written)
        return {n: results[key(n)][0].name for n in numbers}

    def resident(self) -> set[int]:
        return {int.from_bytes(bytes(k.chunk_hash), "big") for k in l1_internals.l1_objects(self.l1)}


@pytest.fixture
def setup() -> Iterator[Setup]:
    made = Setup()
    yield made
    made.l1.clear()
    made.l1.close()


def test_a_full_l1_evicts_the_oldest_clean_object_for_a_new_one(setup: Setup) -> None:
    assert setup.write(1, 2, 3) == {1: "SUCCESS", 2: "SUCCESS", 3: "SUCCESS"}
    setup.state.clean.on_l2_keys_stored([key(2), key(3)], [0, 0])  # 1 is not on L2
    assert setup.write(4) == {4: "SUCCESS"}
    # 1 is older but not clean: kept; of the clean ones LMCache's LRU order picks one
    assert 1 in setup.resident() and 4 in setup.resident()
    assert len(setup.resident() & {2, 3}) == 1
    assert setup.state.stats.snapshot()["evicted_objects"] == 1


def test_nothing_that_is_not_on_l2_is_evicted(setup: Setup) -> None:
    setup.write(1, 2, 3)
    setup.state.clean.on_l2_keys_stored([key(2)], [0])
    setup.state.clean.on_l2_keys_deleted([key(2)])  # gone from L2 since: no longer clean
    assert setup.write(4) == {4: "OUT_OF_MEMORY"}
    assert setup.resident() == {1, 2, 3}
    assert setup.state.stats.snapshot()["evicted_objects"] == 0


def test_a_row_that_fits_only_in_part_gets_its_longest_prefix(setup: Setup) -> None:
    setup.write(1, 2, 3)
    setup.state.clean.on_l2_keys_stored([key(1)], [0])
    assert setup.write(4, 5) == {4: "SUCCESS", 5: "OUT_OF_MEMORY"}
    assert setup.resident() == {2, 3, 4}
