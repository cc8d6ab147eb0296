"""The architecture matrix's bookkeeping: a partial run records its families and keeps the
others' earlier results with their dates; a recipe entry builds its family's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from kvpersist.demo.tiny_families import FAMILIES
from kvpersist.testing.family_matrix import FamilyResult, as_text, write_results


def test_a_partial_run_keeps_the_other_families_with_their_dates(tmp_path: Path) -> None:
    path = tmp_path / "family-matrix.json"
    first = FamilyResult("qwen2", "cached", outcome="cached", full_chunks=4)
    write_results(path, [first], "2026-12-01")
    second = FamilyResult("llama", "cached", outcome="not run",
                          problems=["round 1: RuntimeError"])
    again = FamilyResult("qwen2", "cached", outcome="cached", full_chunks=5)
    write_results(path, [again, second], "2026-12-05")
    data = json.loads(path.read_text())
    assert data["date"] == "2026-12-05"
    rows = {r["family"]: r for r in data["results"]}
    assert [r["family"] for r in data["results"]] == ["llama", "qwen2"]  # FAMILIES order
    assert rows["qwen2"]["full_chunks"] == 5 and rows["qwen2"]["date"] == "2026-12-05"
    assert rows["llama"]["passed"] is False
    third = FamilyResult("llama", "cached", outcome="cached")
    write_results(path, [third], "2026-12-06")
    rows = {r["family"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["qwen2"]["date"] == "2026-12-05" and rows["llama"]["date"] == "2026-12-06"


def test_recipe_entries_name_a_family_that_builds_a_checkpoint() -> None:
    for family in FAMILIES.values():
        if family.builds:
            model = FAMILIES[family.builds]
            assert not model.builds and model.model_type == family.model_type, family.name
            assert family.model_id == model.model_id
        assert family.api in ("chat", "completions"), family.name


def test_a_chat_as_a_completion_prompt_keeps_every_message_in_order() -> None:
    text = as_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert text == "system: s\nuser: u\nassistant:"
