"""LMCache's own benchmark client (``lmcache bench server``), driven from Python.

It is a real client of the MP server that is not ours: it registers mock KV caches, STOREs and
RETRIEVEs chunks over ZMQ (engine_driven on CPU) and checksums the bytes.  Its KV data is seeded
(``torch.random.manual_seed(42)``), so a new client after a server restart has the same bytes to
compare against; for the same reason every restore here zeroes the client's KV first
(``BenchDriver._zero``), so only bytes the retrieve moved can match.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SHAPE_SPEC = "(2,64,16,2,64):float16:2"  # 256-token chunk = 256 KiB of KV
CHECKSUM_CHUNKS = 16  # chunks hashed per checksum request


@dataclass
class TimedRestore:
    """One cold restore: LOOKUP (on the server this includes the L2→L1 load), then RETRIEVE."""

    hit_chunks: int
    lookup_s: float  # LOOKUP alone: the L2→L1 part
    restore_s: float  # LOOKUP + RETRIEVE
    ok: bool  # every expected chunk hit, retrieved, and its checksum matched
    #: ``time.monotonic()`` when the LOOKUP was sent (after the request was built and the
    #: destination zeroed): the clock the server's processes share, so the adapter's
    #: ``last_restore_timeline`` and a device watch are timed from it
    began: float = 0.0


@dataclass
class RoundTrip:
    hit_chunks: int
    total_chunks: int
    retrieved_ok: bool
    checksums_match: bool


#: How long a LOOKUP may take to load from L2 before the bench client reports it as 0 hits.
LOOKUP_POLL_S = 120.0
_ORIGINAL_POLL: dict[str, Any] = {}


def _allow_long_loads(helpers: Any) -> None:
    """The bench client gives a LOOKUP's prefetch 50 polls of 50 ms (2.5 s) and then reports
    0 hits, which a multi-GB load from L2 does not fit in; poll for :data:`LOOKUP_POLL_S`."""
    original = _ORIGINAL_POLL.setdefault("poll", helpers._poll_prefetch_status)
    polls = int(LOOKUP_POLL_S / 0.05)
    helpers._poll_prefetch_status = lambda client, request_id, max_polls=polls, \
        poll_interval=0.05: original(client, request_id, max_polls, poll_interval)


class BenchDriver:
    """One connected ``ServerBenchClient`` using ``model_name`` for its keys; ``mode="gpu"``
    keeps its KV in GPU memory (LMCache's own GPU mode; needs CUDA)."""

    def __init__(self, zmq_url: str, http_url: str, model_name: str, *, num_tokens: int = 1024,
                 shape_spec: str = SHAPE_SPEC, num_blocks: int = 64,
                 transfer_mode: str = "engine_driven", mode: str = "cpu") -> None:
        from lmcache.cli.commands.bench.server_bench import helpers
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        helpers._MODEL_NAME = model_name  # the client module reads it at call time
        _allow_long_loads(helpers)
        self._helpers = helpers
        self.model_name = model_name
        config = BenchConfig(rpc_url=zmq_url, http_url=http_url, mode=mode,
                             transfer_mode=transfer_mode, tp_size=1, use_mla=False,
                             num_tokens=num_tokens, kvcache_shape_spec=shape_spec,
                             num_blocks=num_blocks, block_size=16)
        self.client = ServerBenchClient(config, log=lambda msg: None)
        self.client.start()

    def _request(self, seq: int, kind: str) -> Any:
        self._helpers._MODEL_NAME = self.model_name
        request = self.client.create_request(seq, request_id=f"kvp-{seq}-{kind}", request_kind=kind)
        assert request is not None
        return request

    def _checksums(self, request: Any, tokens: int) -> list[str] | None:
        """Per-chunk checksums of the first ``tokens`` tokens, asked for a few chunks at a time:
        with ``lmcache_driven`` the server hashes them behind an HTTP call the client gives
        5 s, which a 2 GiB request does not fit in."""
        step = CHECKSUM_CHUNKS * request.chunk_size
        out: list[str] = []
        for start in range(0, tokens, step):
            part = self.client.compute_checksums(request, start, min(step, tokens - start))
            if part is None:
                return None
            out += part
        return out

    def checksums(self, seq: int) -> list[str]:
        """Checksums of the client's own data for sequence ``seq`` (what a store would send)."""
        request = self._request(seq, "sum")
        sums = self._checksums(request, request.num_full_tokens)
        assert sums is not None
        return list(sums)

    def store(self, seq: int) -> bool:
        request = self._request(seq, "store")
        result = self.client.store(request, 0, request.num_full_tokens)
        self.client.end_session(request)
        return bool(result is not None and result.succeeded)

    def lookup_and_retrieve(self, seq: int, expected: list[str],
                            between: Callable[[], None] | None = None) -> RoundTrip:
        """LOOKUP, then RETRIEVE the hit prefix into zeroed buffers and compare checksums;
        ``between()`` runs after the LOOKUP (e.g. to stop the server before the RETRIEVE)."""
        request = self._request(seq, "load")
        lookup = self.client.lookup(request)
        if between is not None:
            between()
        hit_tokens = lookup.hit_chunks * request.chunk_size
        ok = True
        match = True
        if hit_tokens:
            self._zero(request, hit_tokens)
            result = self.client.retrieve(request, 0, hit_tokens)
            ok = bool(result is not None and result.succeeded)
            got = self._checksums(request, hit_tokens) or []
            match = list(got) == expected[: lookup.hit_chunks]
        self.client.end_session(request)
        return RoundTrip(lookup.hit_chunks, lookup.total_chunks, ok, match)

    def timed_restore(self, seq: int, expected: list[str]) -> TimedRestore:
        """Restore all of ``seq`` into zeroed buffers, timed; checksums compared after."""
        request = self._request(seq, "load")
        self._zero(request, request.num_full_tokens)
        sent_at = time.monotonic()
        began = time.perf_counter()
        lookup = self.client.lookup(request)
        lookup_s = time.perf_counter() - began
        result = self.client.retrieve(request, 0, lookup.hit_chunks * request.chunk_size)
        restore_s = time.perf_counter() - began
        got = self._checksums(request, request.num_full_tokens)
        self.client.end_session(request)
        ok = (lookup.hit_chunks == len(expected) and result is not None and result.succeeded
              and list(got or []) == expected)
        return TimedRestore(lookup.hit_chunks, lookup_s, restore_s, ok, sent_at)

    def zero_request(self, seq: int) -> None:
        """Zero the client's KV blocks of sequence ``seq`` (what a restore of it writes)."""
        request = self._request(seq, "zero")
        self._zero(request, request.num_full_tokens)
        self.client.end_session(request)

    def _zero(self, request: Any, tokens: int) -> None:
        """Zero the first ``tokens`` of ``request``'s blocks in every retrieving worker's KV.
        LMCache's ``zero_destination`` does this only when the client moves the bytes itself;
        when the server does (``lmcache_driven`` on CPU, the GPU mode) it does nothing, and a new
        client seeds the same data the old one stored, so a retrieve that moved nothing would
        still match the stored checksums."""
        import torch
        from lmcache.cli.commands.bench.server_bench.helpers import _zero_fill_client_blocks

        if not tokens:
            return
        block = self.client._block_size
        for worker in self.client._workers:
            if worker.spec.retrieve_enabled:
                _zero_fill_client_blocks(list(worker.kv_caches.values()),
                                         request.block_offset, tokens // block)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def close(self) -> None:
        self.client.close()
