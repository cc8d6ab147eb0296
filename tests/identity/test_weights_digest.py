"""Weights known by their bytes: the digest, its per-file-version cache, and the engine's
namespace moving when the weights in a local folder are replaced (vLLM's real ``VllmConfig``)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.identity.weights_digest import FileDigestCache, model_files, weights_digest


def _folder(root: Path) -> Path:
    folder = root / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "extra.bin").write_bytes(b"x")
    return folder


def test_any_changed_byte_or_file_gives_another_digest(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cache = FileDigestCache(tmp_path / "cache")
    base = weights_digest(folder, cache)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x01" * 4095 + b"\x02")  # same size, one byte
    changed = weights_digest(folder, cache)
    assert changed != base
    weights.write_bytes(b"\x01" * 4096)
    assert weights_digest(folder, cache) == base
    (folder / "sub" / "extra.bin").rename(folder / "sub" / "other.bin")
    assert weights_digest(folder, cache) != base
    (folder / "sub" / "other.bin").rename(folder / "sub" / "extra.bin")
    (folder / "added.safetensors").write_bytes(b"")
    assert weights_digest(folder, cache) != base


def test_hidden_entries_are_not_part_of_the_model(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cache = FileDigestCache(None)
    base = weights_digest(folder, cache)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("etag")
    (folder / ".gitattributes").write_text("*")
    assert weights_digest(folder, cache) == base
    assert [p.name for p in model_files(folder)] == ["config.json", "model.safetensors",
                                                     "extra.bin"]


def test_a_file_version_is_read_once_and_a_rewrite_in_place_is_seen(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cache = FileDigestCache(tmp_path / "cache")
    read: list[int] = []
    base = weights_digest(folder, cache, read.append)
    assert sum(read) == 4096 + 2 + 1
    read.clear()
    assert weights_digest(folder, cache, read.append) == base
    assert read == []  # every file answered from the cache
    weights = folder / "model.safetensors"
    before = weights.stat()
    with weights.open("r+b") as fh:  # rewritten in place, same size, mtime put back
        fh.write(b"\x07")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    assert weights_digest(folder, cache, read.append) != base  # the ctime moved
    assert read == [4096]


def test_a_cache_that_cannot_be_written_still_gives_the_right_digest(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    assert weights_digest(folder, FileDigestCache(blocked / "cache")) == weights_digest(
        folder, FileDigestCache(None))


def test_a_forged_or_stale_entry_is_never_trusted(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cache = FileDigestCache(tmp_path / "cache")
    base = weights_digest(folder, cache)
    for entry in (tmp_path / "cache").glob("*.json"):
        entry.write_text(entry.read_text().replace('"sha256": "', '"sha256": "0'))
    assert weights_digest(folder, cache) == base


def test_processes_digesting_at_once_agree(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(
        weights_digest(folder, FileDigestCache(tmp_path / "cache")))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and results[0] == weights_digest(folder, FileDigestCache(None))


# --- the engine's namespace, against vLLM's real config


def _other_weights(folder: Path) -> None:
    """Replace ``model.safetensors`` with other weights of the same config, as a retrain into
    the same folder would (config, tokenizer and template byte-identical)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.5
    tmp = folder / "retrained.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


@pytest.mark.integration
def test_weights_replaced_in_a_local_folder_get_another_namespace_without_re_pinning(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpersist.config.client import ConnectorOptions
    from kvpersist.config.server import load_settings
    from kvpersist.serving.connector.gate import resolve_engine_identity
    from kvpersist.serving.launcher.kvp_vllm import kv_transfer_config

    folder = tmp_path / "retrained-here"
    shutil.copytree(tiny_model, folder)  # a local folder: no Hugging Face layout, no revision
    pins = tmp_path / "identity.env"
    assert main(["identity", "write-pins", str(pins), "--vllm-args",
                 f"{folder} --block-size 128 --max-model-len 2048 --dtype float32"]) == 0
    assert "KVP_WEIGHTS_SHA256=" not in pins.read_text()  # left to the engine
    settings = load_settings({"KVP_CACHE_ROOT": "/nonexistent-not-used"})

    def engine_identity(source: str = "engine") -> object:
        from vllm.engine.arg_utils import EngineArgs

        cfg = EngineArgs(model=str(folder), dtype="float32", max_model_len=2048,
                         kv_transfer_config=kv_transfer_config(settings, pins)
                         ).create_engine_config()
        res = resolve_engine_identity(cfg, ConnectorOptions.from_extra_config(
            cfg.kv_transfer_config.kv_connector_extra_config))
        assert res.enabled and res.identity is not None, res.problems
        assert res.sources["weights_sha256"] == source
        return res.identity

    before = engine_identity()
    _other_weights(folder)
    after = engine_identity()
    assert after.namespace != before.namespace  # type: ignore[attr-defined]
    assert after.model_revision == before.model_revision  # type: ignore[attr-defined]
    assert after.weights_sha256 != before.weights_sha256  # type: ignore[attr-defined]
    # The same bytes again: the same namespace (files written before are reachable again).
    shutil.copyfile(tiny_model / "model.safetensors", folder / "model.safetensors")
    assert engine_identity().namespace == before.namespace  # type: ignore[attr-defined]

    # Pinned by the operator: replaced weights close the gate, naming the field.
    capsys.readouterr()
    assert main(["identity", "--model-folder", str(folder), "--json"]) in (0, 3)
    import json

    digest = json.loads(capsys.readouterr().out)["resolved"]["weights_sha256"]
    pins.write_text(pins.read_text() + f"KVP_WEIGHTS_SHA256={digest}\n")
    assert engine_identity("both").namespace == before.namespace  # type: ignore[attr-defined]
    _other_weights(folder)
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(folder), dtype="float32", max_model_len=2048,
                     kv_transfer_config=kv_transfer_config(settings, pins)).create_engine_config()
    res = resolve_engine_identity(cfg, ConnectorOptions.from_extra_config(
        cfg.kv_transfer_config.kv_connector_extra_config))
    assert not res.enabled
    assert any("weights_sha256" in problem for problem in res.problems), res.problems
