"""The closed-world identity: every field of vLLM's engine configuration is classified, each
knob that changes KV moves the namespace or closes the gate, and a default engine stays open."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpersist.identity import FIELDS, merge_sources
from kvpersist.identity.engine_fields import (
    ADDED_AFTER_TESTED,
    ENGINE_FIELDS,
    ClosesGate,
    Namespace,
    Neutral,
    PerRequest,
    closing_reasons,
    expected_absent,
)
from kvpersist.identity.engine_flags import (
    EngineFlagsError,
    hf_overrides_of,
    identity_flags,
    mm_processor_kwargs_of,
)
from kvpersist.identity.sources import from_model_folder, from_vllm_config
from kvpersist.serving.lmcache_compat.engine_config import stale_entries, unclassified


def test_every_engine_field_of_the_installed_vllm_is_classified() -> None:
    """The contract: a vLLM upgrade that adds a configuration field fails here until someone
    decides what it does to KV."""
    assert unclassified() == []
    assert stale_entries() == []


def test_every_decision_says_why_and_names_real_namespace_fields() -> None:
    names = {spec.name for spec in FIELDS}
    for key, decision in ENGINE_FIELDS.items():
        if isinstance(decision, Namespace):
            assert decision.fields and set(decision.fields) <= names, key
        else:
            assert isinstance(decision, (PerRequest, Neutral, ClosesGate)), key
            assert decision.why.strip(), key
    # the knobs the issue names are decided explicitly, not by a default
    for key, kind in [("model_config.quantization", Namespace),
                      ("model_config.hf_overrides", Namespace),
                      ("model_config.dtype", Namespace),
                      ("cache_config.cache_dtype", Namespace),
                      ("model_config.enable_prompt_embeds", PerRequest),
                      ("lora_config.lora_dtype", PerRequest),
                      ("speculative_config.method", Namespace),
                      ("speculative_config.code_revision", ClosesGate),
                      ("model_config.enable_sleep_mode", ClosesGate),
                      ("cache_config.kv_cache_dtype_skip_layers", ClosesGate)]:
        assert isinstance(ENGINE_FIELDS[key], kind), key


def _tree(key: str, value: Any) -> SimpleNamespace:
    """A stand-in engine configuration holding only ``key`` = ``value``."""
    parts = key.split(".")
    node: Any = value
    for part in reversed(parts):
        node = SimpleNamespace(**{part: node})
    return node


@pytest.mark.parametrize("key", sorted(k for k, d in ENGINE_FIELDS.items()
                                       if isinstance(d, ClosesGate)))
def test_each_unkeyable_knob_closes_the_gate_naming_it(key: str) -> None:
    decision = ENGINE_FIELDS[key]
    assert isinstance(decision, ClosesGate)
    reasons = closing_reasons(_tree(key, "some-other-value"))
    assert any(key in r for r in reasons), reasons
    for safe in decision.safe:
        assert not any(key in r for r in closing_reasons(_tree(key, safe))), safe


@pytest.fixture(scope="module")
def engine_config(tiny_model: Path) -> Any:
    """vLLM's own configuration of the tiny model, as ``vllm serve`` would build it."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_model), block_size=128, max_model_len=2048,
                      dtype="float32", enable_lora=True, max_lora_rank=8).create_engine_config()


def test_a_default_engine_with_lora_enabled_stays_open(engine_config: Any) -> None:
    assert closing_reasons(engine_config) == []


def _with_model(engine_config: Any, **changes: Any) -> Any:
    cfg = copy.copy(engine_config)
    model_config = copy.copy(engine_config.model_config)
    for name, value in changes.items():
        object.__setattr__(model_config, name, value)
    object.__setattr__(cfg, "model_config", model_config)
    return cfg


def test_namespace_knobs_move_the_engine_s_identity(engine_config: Any, tiny_model: Path) -> None:
    import torch

    base = from_vllm_config(engine_config)
    # what the engine derives equals what the pins writer derives from the folder and flags
    folder = from_model_folder(tiny_model, dtype="float32")
    for name in ("model_dtype", "quantization", "model_config_sha256"):
        assert base[name] == folder[name], name
    assert from_vllm_config(_with_model(engine_config, dtype=torch.bfloat16))["model_dtype"] \
        == "bfloat16"
    assert from_vllm_config(_with_model(engine_config, quantization="fp8"))["quantization"] \
        == "fp8"
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    scaled = from_vllm_config(_with_model(engine_config, hf_overrides=rope))
    assert scaled["model_config_sha256"] != base["model_config_sha256"]
    assert scaled["model_config_sha256"] == from_model_folder(
        tiny_model, hf_overrides=rope)["model_config_sha256"]
    # overrides given as a function cannot be keyed: the field is missing, caching stays off
    func = from_vllm_config(_with_model(engine_config, hf_overrides=lambda c: c))
    assert "model_config_sha256" not in func


def test_a_checkpoint_s_quantization_and_config_enter_the_identity(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "m"
    folder.mkdir()
    cfg = {"num_attention_heads": 4, "hidden_size": 128, "num_hidden_layers": 2,
           "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(cfg))
    plain = from_model_folder(folder)
    assert plain["quantization"] == "none" and plain["model_dtype"] == "bfloat16"
    (folder / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "FP8"}}))
    quantized = from_model_folder(folder)
    assert quantized["quantization"] == "fp8"
    assert quantized["model_config_sha256"] != plain["model_config_sha256"]
    assert from_model_folder(folder, quantization="awq_marlin")["quantization"] == "awq_marlin"
    assert from_model_folder(folder, dtype="float16")["kv_cache_dtype"] == "float16"


def test_the_pins_writer_reads_the_new_flags_from_the_recipe() -> None:
    flags = identity_flags(["m", "--quantization", "fp8", "--hf-overrides",
                            '{"rope_scaling": {"factor": 2}}', "--dtype", "bfloat16"])
    assert flags.quantization == "fp8" and flags.dtype == "bfloat16"
    assert hf_overrides_of(flags) == {"rope_scaling": {"factor": 2}}
    assert dataclasses.replace(flags, hf_overrides=None).hf_overrides is None



def test_engine_level_processor_kwargs_are_a_namespace_field_not_a_closed_gate(
        engine_config: Any, tiny_model: Path) -> None:
    """``--mm-processor-kwargs`` moves the namespace (the same digest from the recipe's flag
    and from the engine), where it used to close the gate; a value no digest can stand for
    turns caching off even against pins that say 'none'."""
    key = "model_config.multimodal_config.mm_processor_kwargs"
    assert closing_reasons(_tree(key, {"max_pixels": 1000})) == []
    base = from_vllm_config(engine_config)
    assert base["mm_processor_kwargs_sha256"] == "none"
    assert from_model_folder(tiny_model)["mm_processor_kwargs_sha256"] == "none"
    flags = identity_flags(["m", "--mm-processor-kwargs", '{"num_crops": 4, "max_pixels": 1000}'])
    kwargs = mm_processor_kwargs_of(flags)
    assert kwargs == {"num_crops": 4, "max_pixels": 1000}
    pinned = from_model_folder(tiny_model, mm_processor_kwargs=kwargs)
    engine = from_vllm_config(_with_model(engine_config, multimodal_config=SimpleNamespace(
        mm_processor_kwargs={"max_pixels": 1000, "num_crops": 4})))
    assert engine["mm_processor_kwargs_sha256"] == pinned["mm_processor_kwargs_sha256"] != "none"
    other = from_vllm_config(_with_model(engine_config, multimodal_config=SimpleNamespace(
        mm_processor_kwargs={"max_pixels": 2000, "num_crops": 4})))
    assert other["mm_processor_kwargs_sha256"] != engine["mm_processor_kwargs_sha256"]
    opaque = from_vllm_config(_with_model(engine_config, multimodal_config=SimpleNamespace(
        mm_processor_kwargs={"size": object()})))
    resolution = merge_sources({**base, "mm_processor_kwargs_sha256": "none"}, opaque)
    assert resolution.identity is None
    assert any("mm_processor_kwargs_sha256" in p for p in resolution.problems)
    with pytest.raises(EngineFlagsError, match="--mm-processor-kwargs"):
        mm_processor_kwargs_of(identity_flags(["m", "--mm-processor-kwargs", "[1]"]))

# -- vLLM releases newer than the tested one, classified by reading -------------------------------

_RECORDED_0_33 = Path(__file__).parent / "data" / "vllm-0.33.0-engine-fields.txt"


def _recorded_fields(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]


def test_every_engine_field_of_vllm_0_33_is_classified() -> None:
    """vLLM 0.33.0's fields as kvp-admin compat read them from its wheel: none unclassified
    (the gate would close on 0.33.0), and every entry it lacks is one it is expected to lack."""
    recorded = _recorded_fields(_RECORDED_0_33)
    assert len(recorded) == 457
    assert [name for name in recorded if name not in ENGINE_FIELDS] == []
    present = set(recorded)
    assert [name for name in ENGINE_FIELDS
            if name not in present and not expected_absent(name, "0.33.0")] == []


def test_fields_added_after_the_tested_release_are_absent_only_from_older_ones() -> None:
    assert set(ADDED_AFTER_TESTED) <= set(ENGINE_FIELDS)
    name = "watchdog_config.timeout"
    assert ADDED_AFTER_TESTED[name][0] == "0.33.0"
    assert expected_absent(name, "0.32.0") and expected_absent(name, "0.32.9.dev3+g1234")
    assert expected_absent(name, None)
    assert not expected_absent(name, "0.33.0") and not expected_absent(name, "0.33.0rc1")
    assert not expected_absent(name, "0.34.1") and not expected_absent(name, "1.0")
    assert not expected_absent("cache_config.block_size", "0.1.0")
