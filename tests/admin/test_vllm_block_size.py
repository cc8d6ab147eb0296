"""The pins writer's ``block_size`` equals the block size vLLM's engine configuration runs on
this host: for each config below (config.json only, no weights), a real
``EngineArgs(...).create_engine_config()`` is built, which applies the platform's override,
and compared with :func:`kvpersist.admin.vllm_block_size.resolve`.  An MLA model asked for 64
gets 16 on a host without AMX (the AMD EPYC CI host) and 64 with it; the test holds on both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpersist.admin import vllm_block_size
from kvpersist.testing.hf_configs import LLAMA

_LLAMA = LLAMA
_DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 4096,
    "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "qk_nope_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "torch_dtype": "bfloat16",
}


def engine_block_size(folder: Path, requested: int | None) -> int:
    from vllm.engine.arg_utils import EngineArgs

    extra = {} if requested is None else {"block_size": requested}
    config = EngineArgs(model=str(folder), dtype="bfloat16", max_model_len=2048,
                        **extra).create_engine_config()
    return int(config.cache_config.block_size)


@pytest.mark.parametrize("requested", [64, 32, None])
@pytest.mark.parametrize("name,cfg", [("llama", _LLAMA), ("deepseek-v2 (MLA)", _DEEPSEEK_V2)])
def test_the_pins_writer_resolves_the_engines_block_size(tmp_path: Path, name: str,
                                                         cfg: dict[str, Any],
                                                         requested: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert vllm_block_size._cpu_platform() is not None  # the pinned rule is this vLLM's
    assert vllm_block_size.resolve(requested, cfg) == engine_block_size(tmp_path, requested)


def test_the_rule_follows_the_host_and_the_model() -> None:
    mla = _DEEPSEEK_V2
    platform = vllm_block_size._cpu_platform()
    amx = vllm_block_size.amx_mla(platform)
    assert vllm_block_size.resolve(64, mla) == (64 if amx else 16)
    assert vllm_block_size.resolve(64, {**mla, "kv_lora_rank": None}) == 64  # not MLA
    assert vllm_block_size.resolve(64, {**mla, "is_causal": False}) == 64
    assert vllm_block_size.resolve(None, _LLAMA) == 128
    assert vllm_block_size.resolve(64, {**_LLAMA, "model_type": "deepseek_v4"}) == 256


def test_another_vllm_rule_leaves_the_request_as_given(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(vllm_block_size, "CPU_RULE_SOURCE", "0" * 16)
    assert vllm_block_size.resolve(64, _DEEPSEEK_V2) == 64
    assert vllm_block_size.resolve(None, _LLAMA) is None
