"""vLLM frees sliding-window blocks of a request that is still running, and the gate refuses it.

What this proves, on vLLM 0.32's real KV-cache manager (``KVCacheManager`` with two KV-cache
groups, one ``FullAttentionSpec`` and one ``SlidingWindowSpec``, real ``Request`` objects, prefix
caching off so a freed block goes straight back to the pool):

* While request A is still running, ``allocate_slots`` (through the sliding-window manager's
  ``remove_skipped_blocks``) frees the sliding-window blocks of A's first prefill chunk once A
  has moved past the window: A's block table for that group holds the null block in their
  place, the pool counts them free (``ref_cnt`` 0, in the free queue), and the next allocation,
  for request B, hands them out again.  Those are the blocks a store of A's first chunk reads
  when LMCache runs in ``lmcache_driven`` mode (the server reads them after the step returned):
  a store still in flight would read B's KV.  When A's next chunk needs blocks itself, the
  freed blocks are handed back to A's full-attention group in the very same ``allocate_slots``
  call.  None of this is the KV connector's delayed free: vLLM does it on its own.
* A's full-attention blocks are never freed early: after the same steps, a full-attention-only
  engine (and the full-attention group of the hybrid one) still holds every block of A.
* :func:`kvpersist.serving.connector.gate.window_frees_unfenced` refuses the hybrid
  configuration in ``lmcache_driven`` mode and when no mode is given (LMCache's auto), naming
  ``SlidingWindowSpec``; it lets ``engine_driven`` (the copy is done before the step returns)
  and a full-attention-only configuration through.

Negative control: without the refusal (``window_frees_unfenced`` returning None for the hybrid
configuration) ``KvPersistConnector.__init__`` would find nothing unsafe and open the connector
for this engine; what then fails here is ``assert reason is not None`` in
``test_the_gate_refuses_a_sliding_window_group_unless_engine_driven``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from kvpersist.serving.connector.gate import window_frees_unfenced

BLOCK_SIZE = 16
SLIDING_WINDOW = 64
NUM_BLOCKS = 24          # block 0 is vLLM's null block
MAX_MODEL_LEN = 256
CHUNK = 32               # A's prefill chunk (the scheduler's token budget per step)
PROMPT_A = 88            # 32 + 32 + 24: the last prompt block stays partly filled
DECODE_STEPS = 8         # A decodes until its 6 blocks are full: no new block needed
FULL, WINDOW = 0, 1      # group ids of the hybrid configuration


def _full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                             dtype=torch.float16)


def _window_spec() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                             dtype=torch.float16, sliding_window=SLIDING_WINDOW)


def kv_cache_config(*specs: KVCacheSpec) -> KVCacheConfig:
    """One group per spec, one layer each, every group drawing from one pool of ``NUM_BLOCKS``
    block ids (as vLLM's hybrid manager lays them out)."""
    page = specs[0].page_size_bytes
    assert all(spec.page_size_bytes == page for spec in specs)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(specs))]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS * len(names), layers=names,
                                        layer_stride=page * NUM_BLOCKS, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(names, specs, strict=True)],
    )


def hybrid_config() -> KVCacheConfig:
    return kv_cache_config(_full_spec(), _window_spec())


def full_only_config() -> KVCacheConfig:
    return kv_cache_config(_full_spec())


def kv_cache_manager(config: KVCacheConfig) -> KVCacheManager:
    return KVCacheManager(config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=False)


def make_request(request_id: str, num_prompt_tokens: int, first_token: int = 1) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_prompt_tokens)),
                   SamplingParams(max_tokens=64), None)


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[list[int]]:
    """One scheduler step for ``request``: allocate its slots, then advance its computed tokens
    (as vLLM's scheduler does once the step is scheduled).  Returns the new blocks' ids per group."""
    new_blocks = manager.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None, f"{request.request_id}: no room for {num_new_tokens} tokens"
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens += num_new_tokens
    return [list(ids) for ids in new_blocks.get_block_ids()]


def run_request_a(manager: KVCacheManager) -> tuple[Request, list[list[int]]]:
    """A prefills 88 tokens in chunks of 32, samples a token, then decodes 8 tokens (up to 96
    tokens: its sixth block fills, no seventh is needed).  Returns A and the block ids of its
    first chunk per group: the blocks a store of that chunk reads."""
    a = make_request("A", PROMPT_A)
    first_chunk: list[list[int]] | None = None
    while a.num_computed_tokens < PROMPT_A:
        new = schedule(manager, a, min(CHUNK, PROMPT_A - a.num_computed_tokens))
        first_chunk = new if first_chunk is None else first_chunk
    a.append_output_token_ids(7)            # sampled by the last prefill step
    for step in range(DECODE_STEPS):
        schedule(manager, a, 1)
        a.append_output_token_ids(8 + step)
    assert first_chunk is not None
    assert a.num_computed_tokens == PROMPT_A + DECODE_STEPS > SLIDING_WINDOW + CHUNK - 1
    return a, first_chunk


def free_block_ids(manager: KVCacheManager) -> set[int]:
    return {block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()}


def held(manager: KVCacheManager, block_ids: list[int]) -> bool:
    """Every block is referenced and out of the free queue."""
    free = free_block_ids(manager)
    return all(manager.block_pool.blocks[i].ref_cnt > 0 and i not in free for i in block_ids)


def test_the_hybrid_manager_runs_one_full_and_one_sliding_window_group() -> None:
    manager = kv_cache_manager(hybrid_config())
    assert [type(m).__name__ for m in manager.coordinator.single_type_managers] == [
        "FullAttentionManager", "SlidingWindowManager"]
    assert manager.num_kv_cache_groups == 2


def test_a_running_request_s_window_blocks_are_freed_and_handed_to_another_request() -> None:
    manager = kv_cache_manager(hybrid_config())
    a, first_chunk = run_request_a(manager)
    in_flight = first_chunk[WINDOW]          # what a store of A's first chunk reads
    assert len(in_flight) == CHUNK // BLOCK_SIZE

    # A is still running, and vLLM has freed its first chunk's sliding-window blocks.
    assert not a.is_finished()
    table = manager.get_block_ids("A")
    null_id = manager.block_pool.null_block.block_id
    assert table[WINDOW][:len(in_flight)] == [null_id] * len(in_flight)
    assert not set(in_flight) & set(table[WINDOW])
    assert set(in_flight) <= free_block_ids(manager)
    assert all(manager.block_pool.blocks[i].ref_cnt == 0 for i in in_flight)

    # The next allocation, for another request, gets them: a store still reading them would
    # read B's KV.
    b = make_request("B", CHUNK, first_token=1000)
    handed_to_b = schedule(manager, b, CHUNK)
    reused = set(in_flight) & {i for ids in handed_to_b for i in ids}
    assert reused, (in_flight, handed_to_b)
    assert held(manager, sorted(reused))

    # A's full-attention blocks, the first chunk's included, are all still held.
    assert first_chunk[FULL] == table[FULL][:len(first_chunk[FULL])]
    assert null_id not in table[FULL]
    assert held(manager, table[FULL])


def test_a_chunk_past_the_window_is_given_the_blocks_it_just_freed() -> None:
    """Without a decode in between: A's fourth chunk frees its first chunk's window blocks and
    receives them for its own full-attention group in the same ``allocate_slots`` call."""
    manager = kv_cache_manager(hybrid_config())
    a = make_request("A", 4 * CHUNK)
    chunks = [schedule(manager, a, CHUNK) for _ in range(4)]
    in_flight = chunks[0][WINDOW]
    assert not set(in_flight) & set(manager.get_block_ids("A")[WINDOW])
    assert set(in_flight) & set(chunks[3][FULL]), chunks


def test_full_attention_blocks_stay_held_after_the_same_steps() -> None:
    manager = kv_cache_manager(full_only_config())
    a, first_chunk = run_request_a(manager)
    table = manager.get_block_ids("A")
    assert len(table) == 1
    assert first_chunk[0] == table[0][:len(first_chunk[0])]
    assert manager.block_pool.null_block.block_id not in table[0]
    assert len(table[0]) == -(-a.num_computed_tokens // BLOCK_SIZE)
    assert held(manager, table[0])

    b = make_request("B", CHUNK, first_token=1000)
    handed_to_b = schedule(manager, b, CHUNK)
    assert not set(table[0]) & set(handed_to_b[0])


def engine(mode: str | None) -> Any:
    extra = {} if mode is None else {"lmcache.mp.mp_transfer_mode": mode}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


@pytest.mark.parametrize("mode", ["lmcache_driven", None], ids=["lmcache_driven", "auto"])
def test_the_gate_refuses_a_sliding_window_group_unless_engine_driven(mode: str | None) -> None:
    reason = window_frees_unfenced(engine(mode), hybrid_config(), environ={})
    assert reason is not None
    assert "SlidingWindowSpec" in reason
    assert (mode or "auto") in reason


def test_the_gate_lets_engine_driven_through() -> None:
    assert window_frees_unfenced(engine("engine_driven"), hybrid_config(), environ={}) is None
    assert window_frees_unfenced(engine(None), hybrid_config(),
                                 environ={"LMCACHE_MP_TRANSFER_MODE": "engine_driven"}) is None


@pytest.mark.parametrize("mode", ["lmcache_driven", None, "engine_driven"],
                         ids=["lmcache_driven", "auto", "engine_driven"])
def test_the_gate_lets_a_full_attention_only_engine_through(mode: str | None) -> None:
    assert window_frees_unfenced(engine(mode), full_only_config(), environ={}) is None


# -- windows and blocks LMCache's server refuses to register (checked before vLLM depends on it)

def _window(block: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             sliding_window=window)


def _lmcache_refuses(block: int, window: int, chunk: int) -> bool:
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager
    try:
        KVLayerGroupsManager._validate_block_chunk_size_config(0, block, block, chunk, window)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(("block", "window", "chunk"), [
    (64, 200, 256), (64, 192, 256), (64, 256, 256), (64, 300, 256), (16, 200, 256),
    (96, 4096, 256), (128, 100, 256), (128, 2047, 256), (16, 4, 256)])
def test_the_gate_refuses_exactly_the_windows_and_blocks_lmcache_refuses(
        block: int, window: int, chunk: int) -> None:
    """The gate's prediction agrees with LMCache's own validation, rule by rule (a window under
    a chunk not a whole number of blocks; a chunk not a whole number of blocks)."""
    from kvpersist.serving.connector.gate import registration_refusal

    names = ["model.layers.0.self_attn.attn"]
    spec = _window(block, window)
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(
        size=spec.page_size_bytes * 4, layers=names, layer_stride=spec.page_size_bytes * 4,
        block_stride=spec.page_size_bytes)], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    reason = registration_refusal(config, chunk)
    assert (reason is not None) == _lmcache_refuses(block, window, chunk), reason
    if reason is not None:
        assert "LMCache" in reason and str(block) in reason
    assert registration_refusal(config, None) is None  # chunk unknown: registration decides


def test_a_full_attention_engine_with_a_dividing_block_is_registered() -> None:
    from kvpersist.serving.connector.gate import registration_refusal

    assert registration_refusal(full_only_config(), 256) is None


def test_a_window_spec_subclass_or_a_window_inside_a_uniform_type_group_is_refused() -> None:
    """The refusal looks at every layer's spec and at the class it derives from: an MLA model's
    ``SlidingWindowMLASpec`` (MLA is cached, so it reaches the gate) and window layers grouped
    in a ``UniformTypeKVCacheSpecs`` free blocks early just the same."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, UniformTypeKVCacheSpecs

    mla_window = SlidingWindowMLASpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                                      dtype=torch.float16, sliding_window=SLIDING_WINDOW)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    uniform = UniformTypeKVCacheSpecs(block_size=BLOCK_SIZE, kv_cache_specs={
        name: _window_spec() for name in names})
    for spec, layers in ((mla_window, names[:1]), (uniform, names)):
        config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        reason = window_frees_unfenced(engine("lmcache_driven"), config, environ={})
        assert reason is not None and "SlidingWindowSpec" in reason, type(spec).__name__
