"""The architecture matrix's bookkeeping: a partial run records its families and keeps the
others' earlier results with their dates; a recipe entry builds its family's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from kvpersist.demo.tiny_families import FAMILIES
from kvpersist.serving.launcher.vllm_client import ChatResult
from kvpersist.testing.family_matrix import (
    FamilyResult,
    _judge_restored,
    as_text,
    round_problem,
    write_results,
)


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


def _answer(*logprobs: float, cached: int = 0) -> ChatResult:
    return ChatResult(text="", tokens=["a"] * len(logprobs), logprobs=list(logprobs),
                      prompt_tokens=1100, seconds=0.0, cached_tokens=cached)


def _judged(warm: ChatResult, cold: ChatResult,
            reference: tuple[ChatResult, ChatResult] | None) -> FamilyResult:
    result = FamilyResult("llama", "cached", outcome="cached", full_chunks=4)
    _judge_restored(result, cold, warm, 1024.0, reference)
    return result


def test_a_restored_answer_is_judged_against_cold_then_against_the_engine_s_own() -> None:
    cold, warm_ok = _answer(-1.0, -2.0), _answer(-1.0, -2.0, cached=1024)
    assert _judged(warm_ok, cold, None).passed
    wrong = _answer(-1.0, -2.5, cached=1024)
    # without a reference, a difference is a failure
    assert not _judged(wrong, cold, None).passed
    # vLLM's own prefix cache answers as kvpersist does, its cold answer as round 1
    prefix = _judged(wrong, cold, (_answer(-1.0, -2.0), _answer(-1.0, -2.5, cached=1024)))
    assert prefix.outcome == "cached-prefix" and not prefix.problems
    # the engine's own cold answers differ, and the restored one is one of them
    noisy = _judged(wrong, cold, (_answer(-1.0, -2.5), _answer(-1.0, -2.5, cached=1024)))
    assert noisy.outcome == "cached-noisy" and noisy.cold_repeatable is False
    # a restored answer equal to none of the engine's answers fails, naming the token
    bad = _judged(_answer(-1.0, -9.0, cached=1024), cold,
                  (_answer(-1.0, -2.0), _answer(-1.0, -2.0, cached=1024)))
    assert not bad.passed and "at token 1" in bad.problems[0]
    noisy_but_wrong = _judged(_answer(-1.0, -9.0, cached=1024), cold,
                              (_answer(-1.0, -2.5), _answer(-1.0, -2.5, cached=1024)))
    assert not noisy_but_wrong.passed


def test_a_noisy_family_passes_bit_identical_too_and_nothing_else_widens() -> None:
    assert FamilyResult("gpt-oss-full", "cached-noisy", outcome="cached").passed
    assert FamilyResult("gpt-oss-full", "cached-noisy", outcome="cached-noisy").passed
    assert not FamilyResult("gpt-oss-full", "cached-noisy", outcome="refused").passed
    assert not FamilyResult("llama", "cached", outcome="cached-noisy").passed
    assert not FamilyResult("llama", "cached-prefix", outcome="cached").passed


def test_a_failed_round_reports_the_engine_log_once(tmp_path: Path) -> None:
    log = tmp_path / "vllm-deepseek-v2-1.log"
    tail = "[shutdown] EngineCore: trigger received signal=SIGTERM"
    died = round_problem(1, RuntimeError("EngineDeadError"), log, tail)
    assert died.startswith("round 1: RuntimeError: EngineDeadError") and tail in died
    start = RuntimeError(f"vLLM exited with 1 during start; log {log}:\n{tail}")
    assert round_problem(2, start, log, tail).count(tail) == 1
