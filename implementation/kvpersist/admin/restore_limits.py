"""The largest conversation a restore can bring back at once, from the pins and L1 settings.

A restore through L1 (:mod:`kvpersist.serving.restore_window`) is bounded by L1 only where it
cannot stream: an ``engine_driven`` engine, or ``KVP_RESTORE_WINDOW_GB=0``.  There the largest
prefix restored at once is what fits in L1 (after evicting clean chunks); past it the rest is
recomputed.  Streaming restores are bounded by the model's length, not by L1.

Invariant: the KV bytes per token are the whole model's (every rank's share, all in the one
server's L1): ``2 x layers x KV heads x head size x dtype bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config.server import ServerSettings

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
                "fp16": 2, "half": 2}


def dtype_bytes(name: str) -> int:
    """Bytes of one KV element of the pinned ``kv_cache_dtype`` (fp8 variants: 1)."""
    text = name.strip().lower().removeprefix("torch.")
    if text.startswith("fp8") or text.startswith("float8"):
        return 1
    if text not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {name!r}")
    return _DTYPE_BYTES[text]


@dataclass(frozen=True)
class RestoreLimits:
    kv_bytes_per_token: int
    l1_tokens: int  #: tokens of KV that fit in the whole L1
    max_model_len: int
    window_gb: float
    window_tokens: int  #: tokens one streamed window loads (at least one chunk)

    @property
    def streams(self) -> bool:
        return self.window_gb > 0

    @property
    def largest_at_once(self) -> int:
        """Tokens restorable at once by an engine that can stream (else ``l1_tokens``)."""
        return self.max_model_len if self.streams else min(self.l1_tokens, self.max_model_len)


def restore_limits(pinned: Mapping[str, object], settings: ServerSettings) -> RestoreLimits:
    """ValueError when the pins lack a field the size needs."""
    try:
        per_token = (2 * int(str(pinned["num_layers"])) * int(str(pinned["num_kv_heads"]))
                     * int(str(pinned["head_size"]))
                     * dtype_bytes(str(pinned["kv_cache_dtype"])))
        max_len = int(str(pinned["max_model_len"]))
    except KeyError as exc:
        raise ValueError(f"the pins lack {exc.args[0]}") from None
    l1_tokens = int(settings.l1_size_gb * 2**30 // per_token)
    chunk = settings.chunk_size
    window_tokens = max(chunk, int(settings.restore_window_gb * 2**30 // per_token) // chunk
                        * chunk) if settings.restore_window_gb > 0 else 0
    return RestoreLimits(per_token, l1_tokens, max_len, settings.restore_window_gb,
                         window_tokens)


def describe(limits: RestoreLimits) -> tuple[str, str]:
    """(level, message) for ``kvp-admin preflight``."""
    kib = limits.kv_bytes_per_token / 1024
    fits = (f"L1 holds {limits.l1_tokens:,} tokens of KV ({kib:.0f} KiB per token); "
            f"--max-model-len is {limits.max_model_len:,}")
    engine_driven = min(limits.l1_tokens, limits.max_model_len)
    if limits.streams:
        return "ok", (f"{fits}. Largest conversation restored at once: {limits.largest_at_once:,}"
                      f" tokens (lmcache_driven engines stream through L1 in windows of "
                      f"{limits.window_tokens:,} tokens, {limits.window_gb:g} GB); an "
                      f"engine_driven engine restores at most {engine_driven:,}")
    if limits.l1_tokens < limits.max_model_len:
        return "warn", (f"{fits}, and KVP_RESTORE_WINDOW_GB=0 turns streaming off: a conversation"
                        f" longer than {limits.l1_tokens:,} tokens gets only that prefix from "
                        "L2. Raise KVP_L1_SIZE_GB or set KVP_RESTORE_WINDOW_GB=auto")
    return "ok", f"{fits}. Largest conversation restored at once: {limits.largest_at_once:,} tokens"
