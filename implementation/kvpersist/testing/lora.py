"""Random LoRA adapters for the tiny models, in PEFT's on-disk format (no downloads).

Invariants
----------
* The adapter targets ``k_proj`` and ``v_proj`` of every layer, so it changes the KV itself
  (an adapter on the MLP alone would leave layer 0's KV equal to the base model's).
* The same ``seed`` gives the same bytes; different seeds give different weights.
* ``lora_B`` is drawn large enough (``scale``) that the adapter moves greedy tokens of the
  random-weight model, so tests can tell two adapters' KV apart by their answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..demo.tiny_model import TINY, Geometry


def build_random_lora(folder: Path, *, seed: int, geometry: Geometry = TINY, rank: int = 8,
                      scale: float = 0.5) -> Path:
    """Write a random rank-``rank`` LoRA adapter for ``geometry`` into ``folder``."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    kv_width = geometry.kv_heads * geometry.head_dim
    tensors = {}
    for layer in range(geometry.layers):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, geometry.hidden, generator=generator) * scale)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(kv_width, rank, generator=generator) * scale)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": ["k_proj", "v_proj"],
              "base_model_name_or_path": geometry.model_id, "fan_in_fan_out": False,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder
