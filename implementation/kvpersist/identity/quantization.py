"""The ``quantization`` identity field as vLLM's engine resolves it, read from a checkpoint.

A checkpoint declares ``quantization_config.quant_method`` (``mxfp4``, ``gptq``, ``modelopt``),
but the engine's ``model_config.quantization`` is what vLLM's ``ModelConfig._verify_quantization``
makes of it: each quantization method may claim a checkpoint (``override_quantization_method``),
so gpt-oss's ``mxfp4`` becomes ``gpt_oss_mxfp4``, a ModelOpt checkpoint ``modelopt_fp4`` by its
algorithm, and GPTQ ``gptq_marlin`` where the platform has Marlin kernels.

Invariants
----------
* Where vLLM is importable, the name is computed by vLLM's own method on the checkpoint's
  quantization config and ``model_type`` (nothing of it is re-implemented here), so the pins
  writer and the engine agree on the host that serves; overrides that depend on the platform
  (Marlin, AWQ on CPU) resolve for the host the pins are written on.
* Without vLLM, or when vLLM's method cannot run, the checkpoint's declared name is the answer;
  a name the engine then resolves differently closes the gate through the pins check, naming
  ``quantization`` with the engine's value (pinning that value is the right fix).
* vLLM is imported only for a checkpoint that declares a quantization or a recipe that asks
  for one: an unquantized model's pins never pay for the import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

#: The ``quantization`` field of an unquantized model.
NO_QUANTIZATION = "none"


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    text = cfg.get("text_config")
    return text if isinstance(text, Mapping) else {}


def checkpoint_quant_config(cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The checkpoint's ``quantization_config`` (top level, else its text config's), or None."""
    for holder in (cfg, _text_config(cfg)):
        qcfg = holder.get("quantization_config")
        if isinstance(qcfg, Mapping):
            return qcfg
    return None


def checkpoint_quantization(cfg: Mapping[str, Any]) -> str:
    """The weight quantization a checkpoint declares (``quantization_config.quant_method``), or
    ``none``; ``unknown`` for a config without a method."""
    qcfg = checkpoint_quant_config(cfg)
    if qcfg is None:
        return NO_QUANTIZATION
    method = qcfg.get("quant_method")
    return str(method).lower() if method else "unknown"


def _vllm_resolution(qcfg: Mapping[str, Any] | None, user: str | None,
                     cfg: Mapping[str, Any]) -> str | None:
    """What vLLM's ``ModelConfig._verify_quantization`` sets ``quantization`` to for this
    checkpoint and ``--quantization``, or None when vLLM cannot be asked."""
    try:
        from vllm.config.model import ModelConfig
    except Exception:  # no vLLM here (an admin host): the declared name
        return None
    engine = SimpleNamespace(
        quantization=user,
        model_arch_config=SimpleNamespace(quantization_config=dict(qcfg) if qcfg else None),
        hf_config=SimpleNamespace(**{k: v for k, v in cfg.items() if isinstance(k, str)}),
        allow_deprecated_quantization=True)
    try:
        ModelConfig._verify_quantization(engine)  # type: ignore[arg-type]
    except Exception as exc:  # e.g. a method this platform cannot run
        # vLLM names the method before it checks the platform; a name set is the engine's.
        logger.info("kvpersist: vLLM's quantization check on this host: %s", exc)
    resolved = engine.quantization
    return str(resolved).lower() if resolved else None


def engine_quantization(cfg: Mapping[str, Any], user: str | None = None) -> str:
    """The ``quantization`` identity field of a checkpoint served with ``--quantization
    user`` (None: not given), as vLLM's engine resolves it (module invariants)."""
    qcfg = checkpoint_quant_config(cfg)
    if qcfg is None and not user:
        return NO_QUANTIZATION
    resolved = _vllm_resolution(qcfg, user.lower() if user else None, cfg)
    if resolved is not None:
        return resolved
    return user.lower() if user else checkpoint_quantization(cfg)
