"""The diagnostics' answer comparison: exact, with the gap beside it."""

from __future__ import annotations

from kvpersist.serving.launcher.vllm_client import ChatResult
from kvpersist.testing.answer_diff import difference, differing_line


def answer(logprobs: list[float], tokens: list[str] | None = None) -> ChatResult:
    return ChatResult(text="", tokens=tokens or ["a", "b"], logprobs=logprobs, prompt_tokens=9,
                      seconds=0.0, cached_tokens=256)


def test_a_gap_however_small_is_not_bit_identical() -> None:
    same = difference(answer([-1.0, -2.0]), answer([-1.0, -2.0]))
    assert same == {"cached_tokens": 256, "same_tokens": True, "bit_identical": True,
                    "max_logprob_gap": 0.0}
    moved = difference(answer([-1.0, -2.0 + 1e-9]), answer([-1.0, -2.0]))
    assert not moved["bit_identical"] and 0 < moved["max_logprob_gap"] < 1e-8
    assert not difference(answer([-1.0, -2.0], ["a", "c"]), answer([-1.0, -2.0]))["same_tokens"]


def test_the_summary_counts_differing_answers_and_those_under_load() -> None:
    rows = [{"bit_identical": True, "busy": 2}, {"bit_identical": False, "busy": 2},
            {"bit_identical": False, "busy": 0}]
    assert differing_line(rows, "the cold one") == (
        "2 of 3 answers differ from the cold one (1 of them under load)")
