"""Which ranks of a parallel layout hold each chunk: per namespace, files per rank and the chunks
that can never hit because a rank's file is missing.

At TP or PP above 1 each worker stores its own shard of a chunk, under its ``kv_rank``
(LMCache packs ``world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank``).
A restore needs every rank's file of a chunk; LMCache truncates the hit at the first chunk any
rank lacks.  So a chunk with some but not all of its ranks is dead weight.

Invariants
----------
* A chunk is (namespace, model name, object group, chunk hash, cache salt); its expected ranks
  are ``0 .. world_size - 1`` of the world size its files carry.
* A namespace is *complete* when every chunk it holds has every rank; figures come from the
  file names of live files only (the inventory), never from the server.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..l2.inventory import LIVE, Inventory
from ..l2.layout import KeyFields


def world_size_of(kv_rank: int) -> int:
    """The parallel layout's worker count packed into ``kv_rank`` (at least 1)."""
    return max(1, (kv_rank >> 24) & 0xFF)


def global_rank_of(kv_rank: int) -> int:
    return (kv_rank >> 16) & 0xFF


@dataclass
class RankCoverage:
    """One namespace's shards: files per (world size, global rank), and chunks missing ranks."""

    files_per_rank: dict[str, int] = field(default_factory=dict)  # "rank/world" -> files
    chunks: int = 0
    incomplete_chunks: int = 0
    #: "rank/world" -> chunks that lack that rank's file
    missing_per_rank: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.incomplete_chunks == 0

    def as_dict(self) -> dict[str, Any]:
        return {"files_per_rank": dict(sorted(self.files_per_rank.items())),
                "chunks": self.chunks, "incomplete_chunks": self.incomplete_chunks,
                "missing_per_rank": dict(sorted(self.missing_per_rank.items())),
                "complete": self.complete}


def coverage_of_keys(keys: list[KeyFields]) -> dict[str, RankCoverage]:
    """:class:`RankCoverage` per namespace ('(no namespace)' for names without one)."""
    ranks: dict[tuple[str, str, int, bytes, str, int], set[int]] = defaultdict(set)
    out: dict[str, RankCoverage] = {}
    for key in keys:
        ns = key.namespace or "(no namespace)"
        world = world_size_of(key.kv_rank)
        rank = global_rank_of(key.kv_rank)
        cov = out.setdefault(ns, RankCoverage())
        label = f"{rank}/{world}"
        cov.files_per_rank[label] = cov.files_per_rank.get(label, 0) + 1
        ranks[(ns, key.model_name, key.object_group_id, key.chunk_hash, key.cache_salt,
               world)].add(rank)
    for (ns, *_rest, world), have in ranks.items():
        cov = out[ns]
        cov.chunks += 1
        if len(have) < world:
            cov.incomplete_chunks += 1
            for rank in set(range(world)) - have:
                label = f"{rank}/{world}"
                cov.missing_per_rank[label] = cov.missing_per_rank.get(label, 0) + 1
    return out


def rank_coverage(inv: Inventory) -> dict[str, RankCoverage]:
    """:func:`coverage_of_keys` over the inventory's live files."""
    return coverage_of_keys(inv.keys(inv.of_class(LIVE)))
