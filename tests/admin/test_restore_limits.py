"""``kvp-admin preflight``'s largest restorable conversation (pure arithmetic on the pins)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.admin.preflight import run_preflight
from kvpersist.admin.restore_limits import describe, dtype_bytes, restore_limits
from kvpersist.config.server import load_settings

LLAMA_8B = {"num_layers": "32", "num_kv_heads": "8", "head_size": "128",
            "kv_cache_dtype": "bfloat16", "max_model_len": "1048576"}


def test_llama_8b_geometry_is_128_kib_per_token() -> None:
    limits = restore_limits(LLAMA_8B, load_settings({"KVP_L1_SIZE_GB": "64"}))
    assert limits.kv_bytes_per_token == 128 * 1024
    assert limits.l1_tokens == 512 * 1024  # 64 GiB / 128 KiB
    assert limits.streams and limits.largest_at_once == 1048576
    assert limits.window_tokens == 16384  # 2 GB window
    level, message = describe(limits)
    assert level == "ok" and "1,048,576 tokens" in message and "engine_driven" in message


def test_without_streaming_a_small_l1_is_the_limit_and_warns() -> None:
    limits = restore_limits(LLAMA_8B, load_settings({"KVP_L1_SIZE_GB": "64",
                                                      "KVP_RESTORE_WINDOW_GB": "0"}))
    assert limits.largest_at_once == 512 * 1024
    level, message = describe(limits)
    assert level == "warn" and "524,288 tokens" in message and "KVP_RESTORE_WINDOW_GB" in message


def test_dtypes_and_missing_fields() -> None:
    assert (dtype_bytes("float32"), dtype_bytes("torch.bfloat16"), dtype_bytes("fp8_e4m3")) == (
        4, 2, 1)
    with pytest.raises(ValueError):
        dtype_bytes("int3")
    with pytest.raises(ValueError, match="head_size"):
        restore_limits({k: v for k, v in LLAMA_8B.items() if k != "head_size"},
                       load_settings({}))


def test_preflight_prints_the_restore_size(tmp_path: Path) -> None:
    pins = tmp_path / "identity.env"
    pins.write_text("".join(f"KVP_{k.upper()}={v}\n" for k, v in {
        "NUM_LAYERS": "32", "NUM_KV_HEADS": "8", "HEAD_SIZE": "128",
        "KV_CACHE_DTYPE": "bfloat16", "MAX_MODEL_LEN": "131072"}.items()))
    settings = load_settings({"KVP_CACHE_ROOT": str(tmp_path / "cache"), "KVP_L1_SIZE_GB": "8",
                              "KVP_RESTORE_WINDOW_GB": "0"})
    checks = {c.name: c for c in run_preflight(settings, cache_bytes=0, pins=pins,
                                               production=False)}
    assert checks["restore size"].level == "warn"
    assert "65,536 tokens" in checks["restore size"].message
