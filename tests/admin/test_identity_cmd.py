"""kvp-admin: identity resolution, refusals, diff, and status without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.identity import load_pins
from kvpersist.testing.helpers import TINY_PINS, write_pins

REVISION = load_pins(TINY_PINS)["model_revision"]


def tiny_folder(root: Path) -> Path:
    """A config-only copy of the tiny model's folder (no weights needed for identity)."""
    from kvpersist.demo.tiny_model import CHAT_TEMPLATE, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_POS

    snap = root / "models--kvpersist--tiny-llama" / "snapshots" / REVISION
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "max_position_embeddings": MAX_POS,
        "torch_dtype": "float32"}))
    (snap / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return snap


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_identity_pins_and_folder_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--model-folder", str(folder),
                       "--block-size", "128", "--tensor-parallel-size", "1",
                       "--pipeline-parallel-size", "1", "--json")
    data = json.loads(out)
    assert code == 0 and data["enabled"]
    assert data["namespace"].startswith("kvp-") and len(data["namespace"]) == 36
    assert data["lmcache_model_name"] == f"kvpersist/tiny-llama/{data['namespace']}"
    assert data["sources"]["model_revision"] == "both"


def test_identity_disagreement_is_exit_3_naming_field(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--model-folder", str(folder),
                       "--block-size", "64")
    assert code == 3
    assert "caching OFF" in out and "block_size" in out and "pinned 128" in out


def test_identity_incomplete_pins_is_exit_3(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "identity", "--pins", str(TINY_PINS), "--json")
    data = json.loads(out)
    assert code == 3 and not data["enabled"]
    assert any("build" in p for p in data["problems"])


def test_identity_bad_pins_file_is_an_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("KVP_MODEL=foo\n")
    code, _, err = run(capsys, "identity", "--pins", str(bad))
    assert code == 1 and "unknown key 'KVP_MODEL'" in err
    code, _, err = run(capsys, "identity", "--pins", str(tmp_path / "missing.env"))
    assert code == 1 and "cannot read" in err


def test_identity_diff_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_pins(tmp_path / "other.env", tensor_parallel_size="4", block_size="16")
    code, out, _ = run(capsys, "identity", "--diff", str(TINY_PINS), str(other), "--json")
    data = json.loads(out)
    assert code == 0 and not data["same"]
    assert {d["field"] for d in data["differences"]} == {"tensor_parallel_size", "block_size"}
    code, out, _ = run(capsys, "identity", "--diff", str(TINY_PINS), str(TINY_PINS))
    assert "share KV" in out
    code, words, _ = run(capsys, "identity", "diff", str(TINY_PINS), str(other), "--json")
    assert code == 0 and json.loads(words) == data
    code, _, err = run(capsys, "identity", "dif", str(TINY_PINS), str(other))
    assert code == 2 and "identity diff A B" in err


def test_status_without_server(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("KVP_HTTP_PORT", "1")
    code, out, _ = run(capsys, "status", "--json")
    data = json.loads(out)
    assert code == 3 and data["healthy"] is False and data["pid_state"] == "absent"


def test_console_entry_point_help() -> None:
    res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "--help"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "identity" in res.stdout and "status" in res.stdout and "server" in res.stdout
