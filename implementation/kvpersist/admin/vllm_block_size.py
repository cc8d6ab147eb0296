"""The KV block size vLLM will run a recipe with on this host, for the pins writer.

``--block-size`` is a request: vLLM's platform may override it.  On CPU (vLLM 0.32's
``CpuPlatform.check_and_update_config``): an MLA model gets 16 unless the host has AMX tiles
(the reference MLA decode kernel compiles only for 16), DeepSeek-V4 gets 256, and a recipe
without ``--block-size`` gets 128.  A pins file written from the request alone named 64 where
an AMD host's engine ran 16, and the gate closed on it (found by CI on an AMD EPYC host; the
same recipe ran 64 on Intel hosts with AMX).

Invariants
----------
* The rule is vLLM 0.32's, taken from the source pinned below; when this host's vLLM has
  another source for it (or is not vLLM's CPU build) the request is returned unchanged, as
  before, and the gate at start still compares the pin with what the engine runs.
* The answer depends on the host: pins for a fleet of mixed CPUs are written per host kind
  (the namespace differs with the block size, so mixed hosts never share chunks wrongly).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ..serving.connector.platform_refusals import cpu_amx_tiles

logger = logging.getLogger(__name__)

#: sha256 (first 16 hex) of vLLM 0.32.0's ``CpuPlatform.check_and_update_config``.
CPU_RULE_SOURCE = "d2960ad5d1836767"


def _cpu_platform() -> Any | None:
    """vLLM's CPU platform class when this host's vLLM is its CPU build with the pinned rule."""
    try:
        from vllm.platforms import current_platform
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # no vLLM here: the request stands
        return None
    if not current_platform.is_cpu():
        return None
    source = inspect.getsource(CpuPlatform.check_and_update_config)
    if hashlib.sha256(source.encode()).hexdigest()[:16] != CPU_RULE_SOURCE:
        logger.info("kvpersist: vLLM's CPU block-size rule changed; --block-size as given")
        return None
    return CpuPlatform


def uses_mla(text_config: Mapping[str, Any]) -> bool:
    """Whether vLLM runs the model with MLA (``ModelConfig.use_mla``: its own list of MLA model
    types, asked of vLLM's config convertor, unless ``VLLM_MLA_DISABLE`` or not causal)."""
    if os.environ.get("VLLM_MLA_DISABLE", "0") not in ("", "0"):
        return False
    if not text_config.get("is_causal", True):
        return False
    import vllm.config  # noqa: F401 - first: the convertor's module imports it back
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    cfg = SimpleNamespace(**{k: v for k, v in text_config.items() if isinstance(k, str)})
    try:
        return bool(ModelArchConfigConvertorBase(cfg, cfg).is_deepseek_mla())  # type: ignore[arg-type]
    except Exception:  # a config vLLM's check cannot read (an EAGLE head's nested model)
        return False


def resolve(requested: int | None, text_config: Mapping[str, Any] | None) -> int | None:
    """The block size the engine will run (``requested``: ``--block-size``, None if not given;
    ``text_config``: the model's config.json, its text part)."""
    platform = _cpu_platform()
    if platform is None:
        return requested
    cfg = text_config or {}
    if cfg.get("model_type") == "deepseek_v4":
        return 256
    if uses_mla(cfg) and not amx_mla(platform):
        return 16
    return 128 if requested is None else requested


def amx_mla(platform: Any | None = None) -> bool:
    """vLLM's condition for its AMX MLA kernel on this host (no block-size constraint, and
    prefills continue from cached KV); False off vLLM's CPU build."""
    return (platform or _cpu_platform()) is not None and bool(cpu_amx_tiles())
