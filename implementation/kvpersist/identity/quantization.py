"""The ``quantization`` identity field as vLLM's engine resolves it, read from a checkpoint.

A checkpoint declares ``quantization_config.quant_method`` (``mxfp4``, ``gptq``, ``modelopt``),
but the engine's ``model_config.quantization`` is what vLLM's ``ModelConfig._verify_quantization``
makes of it: each quantization method may claim a checkpoint (``override_quantization_method``),
so gpt-oss's ``mxfp4`` becomes ``gpt_oss_mxfp4``, a ModelOpt checkpoint ``modelopt_fp4`` by its
algorithm, and GPTQ ``gptq_marlin`` where the platform has Marlin kernels.

Invariants
----------
* This layer imports no vLLM (``kvp-admin`` runs on hosts without one): the engine's own
  resolution is a :data:`QuantizationResolver` handed in by the pins writer
  (:mod:`kvpersist.admin.vllm_quantization` runs vLLM's method; nothing of it is
  re-implemented), so the pins writer and the engine agree on the host that serves;
  overrides that depend on the platform (Marlin, AWQ on CPU) resolve for the host the pins
  are written on.
* Without a resolver, or when it cannot answer, the declared name is the answer; a name the
  engine then resolves differently closes the gate through the pins check, naming
  ``quantization`` with the engine's value (pinning that value is the right fix).
* The resolver is asked only for a checkpoint that declares a quantization or a recipe that
  asks for one: an unquantized model's pins never pay for importing vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

#: The ``quantization`` field of an unquantized model.
NO_QUANTIZATION = "none"


def checkpoint_quant_config(cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The checkpoint's ``quantization_config`` (top level, else its text config's), or None."""
    text = cfg.get("text_config")
    for holder in (cfg, text if isinstance(text, Mapping) else {}):
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


#: Asks an engine what ``quantization`` becomes: (the checkpoint's quantization config or
#: None, ``--quantization`` lower-cased or None, the checkpoint's config) -> the name, or None
#: when it cannot be asked.  :func:`kvpersist.admin.vllm_quantization.resolve` asks vLLM.
QuantizationResolver = Callable[[Mapping[str, Any] | None, str | None, Mapping[str, Any]],
                                str | None]


def engine_quantization(cfg: Mapping[str, Any], user: str | None = None,
                        resolve: QuantizationResolver | None = None) -> str:
    """The ``quantization`` identity field of a checkpoint served with ``--quantization
    user`` (None: not given), as ``resolve`` says the engine makes it; without a resolver,
    or when it cannot answer, the name given or declared (module invariants)."""
    qcfg = checkpoint_quant_config(cfg)
    if qcfg is None and not user:
        return NO_QUANTIZATION
    resolved = resolve(qcfg, user.lower() if user else None, cfg) if resolve else None
    if resolved is not None:
        return resolved
    return user.lower() if user else checkpoint_quantization(cfg)
