"""The pins writer's ``quantization`` equals what vLLM's own engine configuration resolves for
the same checkpoint: a real ``vllm.config.ModelConfig`` is built for each config below (no
weights are needed) and compared with :func:`engine_quantization` given the admin layer's
vLLM resolver (the one ``write-pins`` hands it)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvpersist.admin.vllm_quantization import resolve
from kvpersist.identity.quantization import checkpoint_quantization, engine_quantization
from kvpersist.testing.hf_configs import LLAMA

_LLAMA = LLAMA
_GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "num_local_experts": 4,
    "num_experts_per_tok": 2, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096,
    "rope_theta": 150000, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "mxfp4"},
}

#: name -> (config.json, whether vLLM renames the declared method for it)
CHECKPOINTS: dict[str, tuple[dict[str, Any], bool]] = {
    "unquantized": (_LLAMA, False),
    "fp8": ({**_LLAMA, "quantization_config": {"quant_method": "fp8"}}, False),
    "gpt-oss mxfp4": (_GPT_OSS, True),
    "modelopt nvfp4": ({**_LLAMA, "quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}}, True),
    "gptq": ({**_LLAMA, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
        "sym": True}}, True),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_pins_writer_resolves_quantization_as_the_engine_does(tmp_path: Path,
                                                                   name: str) -> None:
    from vllm.config import ModelConfig

    cfg, renamed = CHECKPOINTS[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    engine = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True)
    expected = str(engine.quantization).lower() if engine.quantization else "none"
    assert engine_quantization(copy.deepcopy(cfg), resolve=resolve) == expected
    # the declared name alone (what the pins writer wrote before) is wrong exactly here
    assert (checkpoint_quantization(cfg) != expected) == renamed


def test_an_explicit_quantization_is_resolved_too() -> None:
    assert engine_quantization(_LLAMA, "FP8", resolve) == "fp8"
    assert engine_quantization(_GPT_OSS, "mxfp4", resolve) == "gpt_oss_mxfp4"


def test_without_vllm_the_declared_name_is_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm.config.model", None)  # import fails
    assert resolve({"quant_method": "mxfp4"}, None, _GPT_OSS) is None
    assert engine_quantization(_GPT_OSS, resolve=resolve) == "mxfp4"
    assert engine_quantization(_LLAMA, resolve=resolve) == "none"
    assert engine_quantization(_LLAMA, "FP8", resolve) == "fp8"
    assert engine_quantization(_GPT_OSS) == "mxfp4"  # no resolver: the declared name
