"""How one answer differs from a reference answer, for diagnostics that repeat a chat and look for
drift (``benchmarks/diagnostics/cpu_determinism.py``, ``restore_determinism.py``).

Invariant: ``bit_identical`` is exact equality of every logprob (no tolerance); the gap is
reported beside it, never instead of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..serving.launcher.vllm_client import ChatResult


def difference(answer: ChatResult, reference: ChatResult) -> dict[str, Any]:
    """The answer's cached tokens and how it differs from ``reference``: the same tokens, every
    logprob the same, and the largest logprob gap."""
    gap = max((abs(a - b) for a, b in zip(answer.logprobs, reference.logprobs, strict=False)),
              default=0.0)
    return {"cached_tokens": answer.cached_tokens,
            "same_tokens": answer.tokens == reference.tokens,
            "bit_identical": answer.logprobs == reference.logprobs,
            "max_logprob_gap": gap}


def differing_line(rows: Iterable[Mapping[str, Any]], reference: str) -> str:
    """``N of M answers differ from <reference> (K of them under load)`` over rows holding
    :func:`difference`'s fields and ``busy``."""
    rows = list(rows)
    differing = [r for r in rows if not r["bit_identical"]]
    return (f"{len(differing)} of {len(rows)} answers differ from {reference} "
            f"({sum(1 for r in differing if r['busy'])} of them under load)")
