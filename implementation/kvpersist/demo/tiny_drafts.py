"""Tiny random-weight speculative drafts for the tiny families: an EAGLE head and an EAGLE-3
head, built here with no downloads, so the architecture matrix can serve a target with a draft
model.

Invariants
----------
* An EAGLE head (vLLM's ``EagleLlamaForCausalLM``) is one decoder layer of the target's
  geometry without its input norm, an ``fc`` from ``[token embedding, target hidden state]`` to
  the hidden size, and its own embedding; the target's ``lm_head`` is shared. Its attention
  layer has the target's KV geometry, so vLLM puts it in the target's KV-cache group and
  LMCache stores its KV in the target's chunks.
* An EAGLE-3 head (vLLM's ``Eagle3LlamaForCausalLM``, the layout SpecForge and the EAGLE
  authors publish) is one ``midlayer`` whose attention reads ``[normed embedding, normed
  hidden state]`` (twice the hidden size), an ``fc`` from the target's auxiliary hidden states
  (:data:`EAGLE3_AUX_LAYERS`: the embedding and each layer's output of the two-layer target, as
  trained heads take three) to the hidden size, its own ``norm`` and ``lm_head`` over the whole
  vocabulary (no ``d2t`` map), and no embedding (it shares the target's, as published heads
  do). Its attention has the target's KV geometry, so its KV also lands in the target's group.
* Weights are drawn from a seed of their own (``randn * 0.5``), and the head is published in
  the Hugging Face cache layout under ``kvpersist/tiny-<family>-eagle-head`` with a content
  revision, as the families are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tiny_families import _COMMON, FAMILIES, MAX_POS, Family
from .tiny_model import _write_tokenizer, publish_snapshot

SEED = 20261206
#: What a family's ``draft`` may name.
DRAFT_KINDS = ("eagle", "eagle3")
#: the target layers whose input hidden states an EAGLE-3 head reads (0: the embedding output)
EAGLE3_AUX_LAYERS = (0, 1, 2)


def _write_eagle_head(folder: Path, vocab_size: int, target: Family) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**_COMMON, **target.config, "vocab_size": vocab_size, "num_hidden_layers": 1}
    fields = {k: v for k, v in fields.items() if v is not None}
    config = AutoConfig.for_model(target.model_type, **fields)
    torch.manual_seed(SEED)
    layer = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights: dict[str, Any] = {}
    for name, param in layer.state_dict().items():
        if name == "model.layers.0.input_layernorm.weight":
            continue  # EAGLE's first layer has no input norm (vLLM refuses the weight)
        if name.startswith("model.layers.") or name == "model.embed_tokens.weight":
            weights[name.removeprefix("model.")] = (torch.randn_like(param) * 0.5).contiguous()
    hidden = int(fields["hidden_size"])
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.5).contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    config.architectures = ["EagleLlamaForCausalLM"]
    config.save_pretrained(str(folder))


def _write_eagle3_head(folder: Path, vocab_size: int, target: Family) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    fields = {**_COMMON, **target.config, "vocab_size": vocab_size, "num_hidden_layers": 1}
    fields = {k: v for k, v in fields.items() if v is not None}
    hidden, inter = int(fields["hidden_size"]), int(fields["intermediate_size"])
    q_out = int(fields["num_attention_heads"]) * int(fields["head_dim"])
    kv_out = int(fields["num_key_value_heads"]) * int(fields["head_dim"])
    shapes = {
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q_out),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
        "fc.weight": (hidden, len(EAGLE3_AUX_LAYERS) * hidden),
        "lm_head.weight": (vocab_size, hidden),
    }
    generator = torch.Generator().manual_seed(SEED)
    weights = {name: (torch.randn(shape, generator=generator) * 0.5).contiguous()
               for name, shape in shapes.items()}
    save_file(weights, str(folder / "model.safetensors"))
    config = AutoConfig.for_model(target.model_type, **fields)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = vocab_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS)}
    config.save_pretrained(str(folder))


_WRITERS = {"eagle": _write_eagle_head, "eagle3": _write_eagle3_head}


def build_draft(out_dir: str | Path, family: Family) -> Path:
    """Build (or reuse) the draft ``family.draft`` names for ``family``'s checkpoint; return
    its snapshot folder.  ValueError for a family without a known draft kind."""
    if family.draft not in DRAFT_KINDS:
        raise ValueError(f"family {family.name} has no draft to build "
                         f"(draft={family.draft!r}; known: {', '.join(DRAFT_KINDS)})")
    target = FAMILIES[family.builds] if family.builds else family
    if target.model_type != "llama":
        raise ValueError(f"EAGLE heads are built for llama targets only, not "
                         f"{target.model_type} ({family.name})")

    def write(folder: Path) -> None:
        _WRITERS[family.draft](folder, _write_tokenizer(folder, MAX_POS), target)

    return publish_snapshot(out_dir, f"{target.model_id}-{family.draft}-head", write)
