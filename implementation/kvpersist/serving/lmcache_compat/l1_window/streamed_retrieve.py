"""3. A streamed retrieve: the deferred part of a prefix loaded window by window through L1.

The retrieve walks the segments of :func:`kvpersist.serving.restore_window.retrieve_segments`
in order: a *locked* segment (loaded by the lookup) is handed over at once; a *deferred* one is
loaded through LMCache's own prefetch (verified reads, L1 locks) while the windows before it are
handed over, at most ``IN_FLIGHT_WINDOWS`` loads ahead.

Invariants
----------
* Columns are handed over in order and only once they landed in L1, each window with LMCache's
  own retrieve; a window that does not load in full (a bad or deleted file) ends the retrieve
  as failed, never serving a hole.  A window short of L1 (earlier windows' buffers not yet
  released) is loaded again for up to ``WINDOW_RETRY_S``.
* A failed retrieve records what it handed over (``restore_window.SERVED_ROUTE``) before its
  reply leaves, so the worker that asks finds it and vLLM recomputes from the failed chunk on.
* Every window loaded for a retrieve that stopped is released (its L1 read locks returned).
* A retrieve with nothing deferred, or of an unregistered engine, is LMCache's own, unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ... import restore_window as rules
from .state import WindowState, layout_bytes

logger = logging.getLogger("kvpersist.l1_window")

#: How long a streamed window short of L1 is tried again while earlier windows are released.
WINDOW_RETRY_S = 30.0

#: How long a streamed window's load may take before the retrieve gives up (the worker's own
#: wait, ``kvpersist.lookup_max_s``, is the operator's ceiling; this only bounds a thread).
WINDOW_LOAD_MAX_S = 900.0

#: A window's load: LMCache's prefetch handle and the key rows it loads.
Window = tuple[Any, list[Any]]


def retrieve(state: WindowState, module: Any, original: Callable[..., Any], key: Any,
             instance_id: int, gpu_block_ids: list[list[int]], event_ipc_handle: bytes,
             skip_first_n_tokens: int) -> tuple[bytes, bool]:
    """``LMCacheDrivenTransferModule.retrieve`` (``original``), streaming what was deferred."""
    chunk = module._ctx.chunk_size
    state.served.clear(key.request_id, instance_id)
    locked = state.locked_columns(key.request_id)
    streamed_part = not (locked is None or key.start % chunk or key.end % chunk
                         or key.end // chunk <= locked)
    entry = module.get_and_touch_context_entry(instance_id) if streamed_part else None
    if entry is None or locked is None:  # nothing deferred, or unregistered (rejected)
        unchanged: tuple[bytes, bool] = original(module, key, instance_id, gpu_block_ids,
                                                 event_ipc_handle, skip_first_n_tokens)
        return unchanged
    attn_desc = entry.cache_context.kv_layer_groups_manager.get_attn_desc()
    if any(w >= 0 for w in attn_desc.num_chunks_in_sw) or "aux" in attn_desc.group_kinds:
        logger.error("kvpersist: request %s: a streamed restore needs full attention in every "
                     "group; failing it (vLLM recomputes)", key.request_id)
        return b"", False
    stream = StreamedRetrieve(state, module, original, key, instance_id, gpu_block_ids,
                              event_ipc_handle, skip_first_n_tokens, locked, entry.cache_context,
                              attn_desc)
    return stream.run()


class StreamedRetrieve:
    """One retrieve's walk over its segments (see the module docstring).  State: the windows
    loading (``pending``), the reply of the last hand-over, whether all went well, and the
    columns served and streamed so far."""

    def __init__(self, state: WindowState, module: Any, original: Callable[..., Any], key: Any,
                 instance_id: int, gpu_block_ids: list[list[int]], event_ipc_handle: bytes,
                 skip_first_n_tokens: int, locked: int, cache_context: Any,
                 attn_desc: Any) -> None:
        self.state = state
        self.module = module
        self.original = original
        self.key = key
        self.instance_id = instance_id
        self.gpu_block_ids = gpu_block_ids
        self.event_ipc_handle = event_ipc_handle
        self.skip_first_n_tokens = skip_first_n_tokens
        self.attn_desc = attn_desc
        ctx = module._ctx
        self.ctx = ctx
        self.chunk = ctx.chunk_size
        groups_manager = cache_context.kv_layer_groups_manager
        self.groups = list(range(groups_manager.num_object_groups))
        self.layouts = ctx.layout_desc_registry.find_group_layout_descs(key.model_name,
                                                                        key.world_size)
        self.column_bytes = sum(layout_bytes(self.layouts[g]) for g in self.groups)
        self.first = key.start // self.chunk
        self.blocks_per_chunk = [cache_context.calculate_num_blocks(self.chunk, g)
                                 for g in range(groups_manager.num_kernel_groups)]
        per_window = rules.window_columns(state.window_bytes, self.column_bytes)
        self.segments = rules.retrieve_segments(self.first, locked, key.end // self.chunk,
                                                per_window)
        self.deferred = [s for s in self.segments if not s.locked]
        self.pending: dict[int, Window] = {}
        self.next_load = 0
        self.handle = b""
        self.ok = True
        self.served = self.first
        self.streamed = 0

    def run(self) -> tuple[bytes, bool]:
        while self.next_load < min(len(self.deferred), rules.IN_FLIGHT_WINDOWS - 1):
            self._load_next()
        for segment in self.segments:
            if segment.locked:
                self._hand_over(segment.start, segment.end)
            else:
                self._stream(segment)
            if not self.ok:
                break
        for waiting in self.pending.values():  # windows loaded for a retrieve that stopped
            release_window(self.state, waiting)
        self.state.stats.add(streamed_columns=self.streamed,
                             streamed_bytes=self.streamed * self.column_bytes)
        if not self.ok:
            self._record_failure()
        return self.handle, self.ok

    def _stream(self, segment: Any) -> None:
        """Hand over a deferred segment as its window lands, loading the next one meanwhile."""
        window = self.pending.pop(segment.start)
        if self.next_load < len(self.deferred):
            self._load_next()
        col, retry_until = segment.start, time.monotonic() + WINDOW_RETRY_S
        while self.ok and col < segment.end:
            landed, short_of_l1 = wait_window(self.state, window, segment.end - col)
            if landed:
                self._hand_over(col, col + landed)
                col += landed
                self.streamed += landed
            elif not short_of_l1 or time.monotonic() > retry_until:
                self.ok = False  # a file that did not load or verify: never serve a hole
            if self.ok and col < segment.end:
                if not landed:  # L1 was short (the previous window not yet released): again
                    time.sleep(0.05)
                window = self._load(col, segment.end)

    def _load_next(self) -> None:
        segment = self.deferred[self.next_load]
        self.pending[segment.start] = self._load(segment.start, segment.end)
        self.next_load += 1

    def _load(self, start: int, end: int) -> Window:
        """Submit columns [start, end) through LMCache's prefetch."""
        from lmcache.v1.distributed.api import PrefetchTaskSpec, ipc_key_to_grouped_object_keys

        sub = dataclasses.replace(self.key, start=start * self.chunk, end=end * self.chunk)
        hashes = self.ctx.token_hasher.compute_chunk_hashes(list(self.key.token_ids),
                                                            start=sub.start, end=sub.end)
        rows = ipc_key_to_grouped_object_keys(sub, hashes, self.groups, self.layouts,
                                              self.attn_desc)
        spec = PrefetchTaskSpec(key_groups=rows, num_kv_readers=1)
        handle = self.ctx.storage_manager.submit_prefetch_task(
            spec, external_request_id=f"{sub.request_id}/stream@{sub.start}")
        return handle, rows

    def _hand_over(self, start: int, end: int) -> None:
        """LMCache's own retrieve of columns [start, end) into their blocks."""
        sub = dataclasses.replace(self.key, start=start * self.chunk, end=end * self.chunk)
        offset = start - self.first
        blocks = [ids[offset * n:(end - self.first) * n]
                  for ids, n in zip(self.gpu_block_ids, self.blocks_per_chunk, strict=True)]
        self.handle, self.ok = self.original(
            self.module, sub, self.instance_id, blocks, self.event_ipc_handle,
            self.skip_first_n_tokens if start == self.first else 0)
        if self.ok:
            self.served = end

    def _record_failure(self) -> None:
        """Recorded before the failed reply leaves, so the worker that asks finds it."""
        key = self.key
        self.state.served.record(key.request_id, self.instance_id, self.served - self.first)
        lost = key.end // self.chunk - self.served
        self.state.stats.cut("stream_failed", lost * self.chunk)
        logger.warning("kvpersist: request %s: streamed restore stopped at a window that did not "
                       "load in full; %d tokens served, %d recomputed", key.request_id,
                       (self.served - self.first) * self.chunk, lost * self.chunk)


def wait_window(state: WindowState, window: Window, columns: int) -> tuple[int, bool]:
    """(columns of a window that landed in L1, locked once each, from its first; whether an L1
    reservation of it ran out of memory).  The prefetch itself releases every lock outside its
    hit prefix."""
    handle, _rows = window
    sm = state.storage_manager
    deadline = time.monotonic() + WINDOW_LOAD_MAX_S
    while not sm.wait_prefetch_status(handle, 1.0):
        if time.monotonic() > deadline:
            logger.error("kvpersist: a streamed window did not load in %.0f s",
                         WINDOW_LOAD_MAX_S)
            return 0, False
    result = sm.query_prefetch_status(handle)
    short = state.take_short_of_l1(handle.prefetch_request_id)
    if result is None or not result.hit_cells:
        return 0, short
    landed = 0
    while landed < columns and all(row.test(landed) for row in result.hit_cells):
        landed += 1
    return landed, short


def release_window(state: WindowState, window: Window) -> None:
    """Return the locks of a window loaded for a retrieve that stopped before it."""
    handle, rows = window
    sm = state.storage_manager
    if not sm.wait_prefetch_status(handle, WINDOW_LOAD_MAX_S):
        return
    result = sm.query_prefetch_status(handle)
    if result is None:
        return
    keys = [row.keys[col] for row, hit in zip(rows, result.hit_cells, strict=True)
            for col in hit.get_indices_list()]
    if keys:
        sm.finish_read_prefetched(keys, read_locks=1)
