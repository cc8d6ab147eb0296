"""Refusals that depend on what vLLM's platform makes of the engine on this host.

Apart from :mod:`.gate`, which runs anywhere (``kvp-admin`` on a host without vLLM): these read
vLLM's platform and torch, and run only inside vLLM's processes, where the connector calls them
before LMCache's connector starts.
"""

from __future__ import annotations

from typing import Any


def cpu_amx_tiles() -> bool | None:
    """Whether vLLM's CPU platform runs on an x86 host with AMX tiles (its condition for the
    AMX MLA kernel); None where vLLM is not importable or not its CPU build."""
    try:
        import torch
        from vllm.platforms import CpuArchEnum, current_platform
    except Exception:  # not inside vLLM: nothing to judge
        return None
    if not current_platform.is_cpu():
        return None
    return (current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and bool(torch.cpu._is_amx_tile_supported()))


def prefill_cannot_resume(vllm_config: Any) -> str | None:
    """Why this engine cannot continue a prefill from KV it did not compute, or None.

    vLLM's CPU platform runs an MLA model on its reference kernel unless the host has AMX tiles
    (``CpuPlatform.check_and_update_config``: x86 with AMX and no forced ``CPU_MLA`` backend,
    or DeepSeek-V4 with AMX); that kernel has no prefill over a cached prefix, and vLLM turns
    chunked prefill and its own prefix cache off for it.  A prefix restored from the tier would
    be attended wrongly: measured on an AMD EPYC host, a DeepSeek-V2 answer restored at block
    16 differed from cold.  Only vLLM's own conditions are read; nothing else is refused."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False):
        return None
    amx = cpu_amx_tiles()
    if amx is None:
        return None
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    forced_reference = getattr(backend, "name", None) == "CPU_MLA"
    deepseek_v4 = getattr(getattr(model, "hf_config", None), "model_type", None) == "deepseek_v4"
    if amx and (deepseek_v4 or not forced_reference):
        return None
    return ("vLLM runs this MLA model on its CPU reference kernel (no AMX on this host), which "
            "cannot continue a prefill from cached KV (vLLM turns chunked prefill and prefix "
            "caching off for it): a restored prefix would be attended wrongly; serve it "
            "uncached, or on a host with AMX")
