"""The hit rate an ideal LRU cache of a given byte budget would give on a recorded trace.

The yardstick for a traffic run: replay the requests in the order they were sent, each
looking up its prompt's full chunks as a prefix (the first missing chunk ends the hit, as
LMCache's lookup does), then storing or touching all of them.  The cache holds whole chunks,
least recently used out first, and never more than ``budget_bytes``.

Invariants
----------
* A chunk is named by (conversation, index): turns of one conversation extend each other and
  conversations share nothing (:mod:`.shape`), so the name is the content's.
* Only full chunks count, as only they are stored; a request's hit is at most its full chunks.
* The replay is exact for its model: no admission policy, no watermark hysteresis, no store
  dropped, no L1 in front; the measured tier differs from it by exactly those (its report says
  by how much).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ...config.registry import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class Access:
    """One request of a trace: the conversation it continues and its prompt's length."""

    conversation: str
    prompt_tokens: int


@dataclass(frozen=True)
class Replay:
    """Per request of the trace, in order: the tokens an ideal LRU would have served."""

    hit_tokens: list[int]
    chunk_tokens: int

    def hit_rate(self, prompt_tokens: Iterable[int]) -> float:
        """Served tokens over all prompt tokens (0 for an empty trace)."""
        total = sum(prompt_tokens)
        return sum(self.hit_tokens) / total if total else 0.0


def replay_lru(trace: Iterable[Access], *, budget_bytes: int, chunk_bytes: int,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Replay:
    """Replay ``trace`` through an LRU of ``budget_bytes`` holding chunks of ``chunk_bytes``."""
    if chunk_bytes <= 0 or chunk_tokens <= 0:
        raise ValueError("chunk_bytes and chunk_tokens must be positive")
    capacity = budget_bytes // chunk_bytes
    held: OrderedDict[tuple[str, int], None] = OrderedDict()
    hits: list[int] = []
    for access in trace:
        full = access.prompt_tokens // chunk_tokens
        served = 0
        while served < full and (access.conversation, served) in held:
            served += 1
        hits.append(served * chunk_tokens)
        for index in range(full):
            key = (access.conversation, index)
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > capacity:
            held.popitem(last=False)
    return Replay(hits, chunk_tokens)
