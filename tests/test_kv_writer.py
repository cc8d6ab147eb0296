"""The synthetic-KV writer's own rules: which engines it writes for, and the object-to-blocks
mapping (proven against vLLM's real files by ``tests/e2e/test_kv_writer_e2e.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpersist.testing.kv_writer import (
    EngineLayout,
    L2Pacer,
    WriterError,
    chunk_from_object,
    namespace_record,
    seeded_fill,
)

FIELDS = {"num_layers": 2, "num_kv_heads": 2, "head_size": 32, "block_size": 128,
          "kv_cache_dtype": "float32", "tensor_parallel_size": 1, "pipeline_parallel_size": 1}


def record(folder: Path, name: str, **changes: object) -> Path:
    path = folder / "namespaces" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"lmcache_model_name": f"org/m/{name}",
                                "fields": {**FIELDS, **changes}}))
    return path


def test_a_record_gives_the_engine_layout_and_other_engines_are_refused(tmp_path: Path) -> None:
    layout = EngineLayout.from_record(record(tmp_path, "kvp-" + "a" * 32))
    assert layout == EngineLayout("org/m/kvp-" + "a" * 32, 2, 2, 32, 128, torch.float32)
    assert layout.chunk_shape == (2, 2, 2, 128, 64) and layout.chunk_bytes == 256 << 10
    with pytest.raises(WriterError, match="TP 2, PP 1"):
        EngineLayout.from_record(record(tmp_path, "tp", tensor_parallel_size=2))
    with pytest.raises(WriterError, match="KV dtype 'fp8'"):
        EngineLayout.from_record(record(tmp_path, "q", kv_cache_dtype="fp8"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(WriterError, match="not a namespace record"):
        EngineLayout.from_record(tmp_path / "bad.json")


def test_the_record_is_found_only_when_one_matches(tmp_path: Path) -> None:
    with pytest.raises(WriterError, match="0 namespace records"):
        namespace_record(tmp_path)
    only = record(tmp_path, "kvp-" + "a" * 32)
    assert namespace_record(tmp_path) == only
    record(tmp_path, "kvp-" + "b" * 32)
    with pytest.raises(WriterError, match="2 namespace records"):
        namespace_record(tmp_path)
    assert namespace_record(tmp_path, "org/m/kvp-bb") != only


def test_an_object_row_is_a_token_with_every_head_and_blocks_are_heads_first() -> None:
    layout = EngineLayout("m", 2, 2, 32, 128, torch.float32)
    # object [1, layers, 256 tokens, heads * 64]: value = layer*1e6 + token*1e3 + head
    obj = torch.zeros(1, 2, 256, 2, 64)
    for layer in range(2):
        for head in range(2):
            obj[0, layer, :, head] = (layer * 1e6 + torch.arange(256) * 1e3 + head)[:, None]
    blocks = chunk_from_object(layout, obj.numpy().tobytes())
    assert blocks.shape == layout.chunk_shape
    # blocks [layers, 2 blocks, heads, 128 tokens, 64]
    assert blocks[1, 1, 0, 5, 0] == 1e6 + (128 + 5) * 1e3 + 0
    assert blocks[0, 0, 1, 127, 63] == 127 * 1e3 + 1
    with pytest.raises(WriterError, match="not one chunk"):
        chunk_from_object(layout, b"\0" * 1024)


def test_seeded_kv_depends_only_on_the_seed_and_the_chunk() -> None:
    a, b, c = (torch.empty(2, 2, 2, 128, 64) for _ in range(3))
    seeded_fill(1)(3, a)
    seeded_fill(1)(3, b)
    seeded_fill(1)(4, c)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_the_pacer_waits_for_l2_and_reports_drops(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.kvp").write_bytes(b"")
    pacer = L2Pacer([tmp_path], slack=2, stall_s=0.3)
    pacer(5)  # 3 files, 5 written, 2 allowed behind: no wait
    with pytest.raises(WriterError, match="L2 holds 3 of 4 chunks"):
        pacer(6)


def test_the_pacer_counts_the_chunks_of_every_root(tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    for root, count in zip(roots, (2, 3), strict=True):
        root.mkdir()
        for i in range(count):
            (root / f"{i}.kvp").write_bytes(b"")
    (roots[0] / "note.txt").write_bytes(b"")  # not a chunk
    pacer = L2Pacer(roots, slack=0, stall_s=0.3)
    assert pacer.on_disk() == 5
    pacer(5)
    with pytest.raises(WriterError, match="L2 holds 5 of 6 chunks"):
        pacer(6)
