"""vLLM's own answer to what a checkpoint's ``quantization`` becomes in the engine: the
:data:`~kvpersist.identity.quantization.QuantizationResolver` the pins writer hands to
:func:`~kvpersist.identity.sources.from_model_folder`.

Invariant: the name is computed by vLLM's ``ModelConfig._verify_quantization`` itself, run on
the checkpoint's quantization config, ``--quantization`` and the config's fields (its
``model_type`` above all); nothing of vLLM's method table is copied here.  vLLM names the
method before it checks that this platform can run it, so a host that cannot (an admin host
without a GPU) still learns the name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)


def resolve(qcfg: Mapping[str, Any] | None, user: str | None,
            cfg: Mapping[str, Any]) -> str | None:
    """What vLLM sets ``model_config.quantization`` to for this checkpoint and
    ``--quantization``, lower-cased, or None when vLLM cannot be imported."""
    try:
        from vllm.config.model import ModelConfig
    except Exception:  # no vLLM on this host: the declared name stands
        return None
    engine = SimpleNamespace(
        quantization=user,
        model_arch_config=SimpleNamespace(quantization_config=dict(qcfg) if qcfg else None),
        hf_config=SimpleNamespace(**{k: v for k, v in cfg.items() if isinstance(k, str)}),
        allow_deprecated_quantization=True)
    try:
        ModelConfig._verify_quantization(engine)  # type: ignore[arg-type]
    except Exception as exc:  # e.g. a method this platform cannot run, named already
        logger.info("kvpersist: vLLM's quantization check on this host: %s", exc)
    resolved = engine.quantization
    return str(resolved).lower() if resolved else None
