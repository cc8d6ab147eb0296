"""Small ``config.json`` contents of real architectures, for tests that build vLLM's engine
configuration from a folder holding nothing but that file (no weights are read)."""

from __future__ import annotations

from typing import Any

#: A two-layer Llama with GQA, bfloat16 weights.
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
