"""The identity gate against vLLM's real ``VllmConfig`` (no engine started, no server needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import TINY_PINS, write_pins

pytestmark = pytest.mark.integration


def engine_config(model: Path, pins: Path, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from kvpersist.settings import load_settings
    from kvpersist.vllm_launch import kv_transfer_config

    settings = load_settings({"KVP_CACHE_ROOT": "/nonexistent-not-used"})
    args = dict(model=str(model), dtype="float32", max_model_len=2048,
                kv_transfer_config=kv_transfer_config(settings, pins))
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def test_engine_identity_matches_pins(tiny_model: Path) -> None:
    from kvpersist.connector import resolve_engine_identity

    res = resolve_engine_identity(engine_config(tiny_model, TINY_PINS))
    assert res.enabled, res.problems
    assert res.identity is not None
    assert res.identity.model_revision == tiny_model.name
    # Fields the engine itself derived were cross-checked against the pins.
    for name in ("kv_cache_dtype", "block_size", "num_kv_heads", "head_size", "max_model_len",
                 "model_revision", "chat_template_sha256"):
        assert res.sources[name] == "both", (name, res.sources[name])
    assert res.sources["build"] == "engine"


def test_engine_dtype_disagreeing_with_pin_turns_caching_off(tiny_model: Path) -> None:
    from kvpersist.connector import resolve_engine_identity

    res = resolve_engine_identity(engine_config(tiny_model, TINY_PINS, dtype="bfloat16"))
    assert not res.enabled
    assert any("kv_cache_dtype" in p and "bfloat16" in p for p in res.problems), res.problems


def test_wrong_pin_turns_caching_off_and_names_field(tiny_model: Path, tmp_path: Path) -> None:
    from kvpersist.connector import resolve_engine_identity

    pins = write_pins(tmp_path / "bad.env", block_size="64")
    res = resolve_engine_identity(engine_config(tiny_model, pins))
    assert not res.enabled
    assert any("block_size" in p for p in res.problems), res.problems


def test_missing_pins_file_turns_caching_off(tiny_model: Path, tmp_path: Path) -> None:
    from kvpersist.connector import resolve_engine_identity

    pins = write_pins(tmp_path / "ok.env")
    cfg = engine_config(tiny_model, pins)
    pins.unlink()
    res = resolve_engine_identity(cfg)
    assert not res.enabled and "cannot read" in res.problems[0]


def test_disabled_connector_reports_no_hits(tiny_model: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.connector import DisabledKvConnector, KvPersistConnector

    pins = write_pins(tmp_path / "bad.env", head_size="64")
    conn = KvPersistConnector(engine_config(tiny_model, pins), KVConnectorRole.SCHEDULER)
    assert isinstance(conn, DisabledKvConnector)
    assert "head_size" in conn.disabled_reason
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert conn.request_finished(object(), [1, 2]) == (False, None)
