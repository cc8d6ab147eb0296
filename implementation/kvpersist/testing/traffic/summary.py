"""Figures of a traffic run, computed from its records and samples: hit rate over time against
an ideal LRU, time to first token by length for hits and misses, the inter-token latency of
streams while long restores run, and the trend of what the processes hold.

Invariants
----------
* Only successful requests enter a latency or hit-rate figure; failed ones are counted apart.
* A request is a *hit* when any of its prompt came from the cache (``cached_tokens > 0``).
* Percentiles are nearest-rank over the values given; an empty set gives ``None``, never 0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from ...config.registry import DEFAULT_CHUNK_TOKENS
from .ideal_lru import Access, replay_lru
from .users import RequestRecord

#: Prompt-length buckets (tokens) for the latency tables: [low, high).
LENGTH_BUCKETS = ((0, 2048), (2048, 8192), (8192, 32768), (32768, 1 << 30))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def answered(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The successful requests, in the order they were sent."""
    return sorted((r for r in records if r.error is None), key=lambda r: r.started_s)


def hit_rates(records: Sequence[RequestRecord], *, window_s: float, chunk_bytes: int,
              budgets: dict[str, int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> dict[str, Any]:
    """Measured hit rate (cached over prompt tokens) per window of ``window_s`` and over the
    run, beside what an ideal LRU of each of ``budgets`` (name → bytes) gives on the same
    requests in the same order."""
    done = answered(records)
    trace = [Access(r.conversation, r.prompt_tokens) for r in done]
    ideal = {name: replay_lru(trace, budget_bytes=b, chunk_bytes=chunk_bytes,
                              chunk_tokens=chunk_tokens).hit_tokens
             for name, b in budgets.items()}
    windows: dict[int, dict[str, float]] = {}
    for i, r in enumerate(done):
        w = windows.setdefault(int(r.started_s // window_s),
                               {"prompt": 0, "measured": 0, **dict.fromkeys(ideal, 0)})
        w["prompt"] += r.prompt_tokens
        w["measured"] += r.cached_tokens
        for name, hits in ideal.items():
            w[name] += hits[i]
    total_prompt = sum(r.prompt_tokens for r in done)

    def rate(part: float, whole: float) -> float | None:
        return part / whole if whole else None

    return {
        "window_s": window_s,
        "overall": {"measured": rate(sum(r.cached_tokens for r in done), total_prompt),
                    **{name: rate(sum(h), total_prompt) for name, h in ideal.items()}},
        "windows": [{"t_s": k * window_s, "requests_tokens": w["prompt"],
                     "measured": rate(w["measured"], w["prompt"]),
                     **{name: rate(w[name], w["prompt"]) for name in ideal}}
                    for k, w in sorted(windows.items())],
    }


def around_events(records: Sequence[RequestRecord], events: Sequence[dict[str, Any]], *,
                  span_s: float = 300.0) -> list[dict[str, Any]]:
    """The measured hit rate (cached over prompt tokens) of the requests sent in the
    ``span_s`` before each event (``t_s``, ``action``, ``seconds``) began and in the ``span_s``
    after it ended: what an operator's action (a cleanup, a quota, a restart) changed.  Each
    side's figure is ``None`` when no request was answered there; the trend of the run itself
    (conversations outgrowing the budget) is in both sides, so a difference is only the
    action's where the run's windows around it are flat."""
    done = answered(records)

    def rate(low: float, high: float) -> dict[str, Any]:
        part = [r for r in done if low <= r.started_s < high]
        prompt = sum(r.prompt_tokens for r in part)
        return {"requests": len(part),
                "hit_rate": sum(r.cached_tokens for r in part) / prompt if prompt else None}

    out = []
    for event in events:
        began = float(event["t_s"])
        ended = began + float(event.get("seconds") or 0.0)
        out.append({"action": event["action"], "t_s": began, "span_s": span_s,
                    "before": rate(began - span_s, began), "after": rate(ended, ended + span_s)})
    return out


def ttft_by_length(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """TTFT p50/p99 for hits and misses in each of :data:`LENGTH_BUCKETS`."""
    rows = []
    done = answered(records)
    for low, high in LENGTH_BUCKETS:
        inside = [r for r in done if low <= r.prompt_tokens < high]
        if not inside:
            continue
        rows.append({"tokens": [low, high],
                     "hits": spread([r.ttft_s for r in inside if r.cached_tokens > 0]),
                     "misses": spread([r.ttft_s for r in inside if r.cached_tokens == 0])})
    return rows


def inter_token_latency(records: Sequence[RequestRecord], *, restore_tokens: int
                        ) -> dict[str, Any]:
    """Gaps between a stream's tokens, split by whether another request restoring at least
    ``restore_tokens`` from the cache was before its first token then (its interval from send
    to first token: the restore, and whatever queueing preceded it)."""
    done = answered(records)
    restores = [(r.seq, r.started_s, r.started_s + r.ttft_s) for r in done
                if r.cached_tokens >= restore_tokens]
    during: list[float] = []
    outside: list[float] = []
    for r in done:
        times = [r.started_s + t for t in r.token_times]
        for a, b in itertools.pairwise(times):
            overlaps = any(seq != r.seq and lo < b and a < hi for seq, lo, hi in restores)
            (during if overlaps else outside).append(b - a)
    return {"restore_tokens_at_least": restore_tokens, "restores": len(restores),
            "during_restores": spread(during), "otherwise": spread(outside)}


def trend(samples: Sequence[dict[str, Any]], key: str, *, warm_fraction: float = 0.25
          ) -> dict[str, Any]:
    """How ``key`` moved after warm-up: the median of the samples just after the first
    ``warm_fraction`` of the run against the median of the last quarter, and the ratio."""
    values = [float(s[key]) for s in samples if s.get(key) is not None]
    if len(values) < 8:
        return {"key": key, "samples": len(values), "after_warm_up": None, "end": None,
                "ratio": None}
    start = int(len(values) * warm_fraction)
    quarter = max(1, len(values) // 4)
    early = percentile(values[start:start + quarter], 50)
    late = percentile(values[-quarter:], 50)
    ratio = late / early if early and late is not None else None
    return {"key": key, "samples": len(values), "after_warm_up": early, "end": late,
            "ratio": ratio}
