"""The ``draft_sha256`` identity field: what a speculative draft model adds to the KV.

A draft-model proposer (EAGLE, EAGLE-3, MTP, a small draft model) registers its own attention
layers beside the target's, and LMCache stores and restores them with the target's in every
chunk. Their KV for a token sequence depends on the draft's weights and configuration, on how
the method builds the draft's input (EAGLE feeds the target's hidden states, which the target's
own fields key), and on the draft's dtype, quantization and tensor parallelism. This field
digests exactly those, as the running engine resolved them.

Invariants
----------
* ``"none"`` when the engine has no speculative config or a draft-free proposer
  (:data:`~kvpersist.identity.engine_fields.DRAFT_FREE_METHODS`): the chunk then holds the
  target's layers only, and every earlier namespace is unchanged (the field is optional).
* Otherwise the sha256 of the canonical JSON of :func:`draft_fields`; a value it cannot read
  (a draft folder that cannot be digested, an ``hf_overrides`` function) leaves the field out,
  and the gate then turns caching off as for any missing field.
* Engine only: the pins writer does not write it (the recipe's JSON is resolved by vLLM in
  ways a reader would have to repeat: the method inferred from the draft's name, the draft's
  dtype and quantization); the engine's value enters the namespace.
* A restored chunk's draft KV at its last position was computed with the token that followed
  the chunk when it was stored (EAGLE shifts its input by one token). Another continuation can
  only change what the draft proposes, which the target verifies: acceptance, never a token.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .engine_fields import DRAFT_FREE_METHODS
from .fields import NO_DRAFT
from .sources import engine_model_config_digest, engine_weights_digest
from .weights_digest import FileDigestCache

#: ``SpeculativeConfig`` fields digested as the engine holds them (None where unset).
_SPEC_VALUES = ("method", "num_speculative_tokens", "kv_cache_dtype", "max_model_len",
                "revision", "parallel_drafting", "use_heterogeneous_vocab",
                "index_share_for_mtp_iteration", "num_speculative_tokens_per_batch_size")


def _plain(value: Any) -> Any:
    """A JSON-able form of a config value (enums and dtypes by their names)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(getattr(value, "value", value)).removeprefix("torch.")


#: vLLM's own transform of every draft's config (``SpeculativeConfig.hf_config_override``).
_VLLM_DRAFT_OVERRIDE = ("vllm.config.speculative", "SpeculativeConfig.hf_config_override")


def _vllm_draft_override(overrides: Any) -> bool:
    return (getattr(overrides, "__module__", None),
            getattr(overrides, "__qualname__", None)) == _VLLM_DRAFT_OVERRIDE


def draft_fields(spec: Any, digests: FileDigestCache) -> dict[str, Any] | None:
    """What makes the draft's KV: the speculative settings, and the draft model's folder
    digest, config digest, dtype, quantization and tensor parallelism.  None when the draft
    folder or its config cannot be digested."""
    values: dict[str, Any] = {name: _plain(getattr(spec, name, None)) for name in _SPEC_VALUES}
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return None
    try:
        weights = engine_weights_digest(draft, digests)
        config = engine_model_config_digest(draft, build_code=_vllm_draft_override)
    except ValueError:  # a name the hub cache refuses to look up (no such folder either)
        return None
    if weights is None or config is None:
        return None
    parallel = getattr(spec, "draft_parallel_config", None)
    values.update(
        draft_weights_sha256=weights, draft_config_sha256=config,
        draft_dtype=_plain(getattr(draft, "dtype", None)),
        draft_quantization=_plain(getattr(draft, "quantization", None)),
        draft_tensor_parallel_size=_plain(getattr(parallel, "tensor_parallel_size", None)))
    return values


def draft_digest(vllm_config: Any, digests: FileDigestCache) -> str | None:
    """``draft_sha256`` of a running engine (see module invariants)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) in DRAFT_FREE_METHODS:
        return NO_DRAFT
    fields = draft_fields(spec, digests)
    if fields is None:
        return None
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
