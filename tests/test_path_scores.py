"""The served-answer scoring's own logic (:mod:`kvpersist.testing.traffic.path_scores`): the
judgement and its control, the misplaced chunk, and the requests it sends, against a local
HTTP stub of vLLM's ``/tokenize`` and ``/v1/completions`` (the real engine scores the traffic
run's sample in ``tests/e2e/test_traffic_e2e.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest

from kvpersist.testing.http_stub import http_stub
from kvpersist.testing.traffic.path_scores import (
    CONTROL_CHUNK_TOKENS,
    PathScoreError,
    judge,
    misplaced_chunk,
    score_and_judge,
    token_ids,
)

TOL = 1e-3


def test_an_answer_within_tolerance_with_a_seeing_control_passes() -> None:
    out = judge([-1.0, -2.0], [-1.0, -2.0 + 5e-4], [-3.0, -2.5], tolerance=TOL)
    assert out["ok"] and not out["blind"]
    assert out["max_delta"] == pytest.approx(5e-4) and out["control_max_delta"] == 2.0


def test_an_answer_off_by_more_than_the_tolerance_fails() -> None:
    out = judge([-1.0, -2.0], [-1.0, -2.02], [-3.0, -2.5], tolerance=TOL)
    assert not out["ok"] and not out["blind"]


def test_a_control_that_does_not_move_the_scores_makes_the_judgement_blind() -> None:
    # the scores agree, but a misplaced chunk would have agreed too: no evidence either way
    out = judge([-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0 + 5e-3], tolerance=TOL)
    assert out["blind"] and not out["ok"]


def test_a_judgement_of_different_lengths_or_nothing_is_refused() -> None:
    with pytest.raises(PathScoreError, match="lengths"):
        judge([-1.0], [-1.0, -2.0], [-1.0, -2.0], tolerance=TOL)
    with pytest.raises(PathScoreError, match="empty"):
        judge([], [], [], tolerance=TOL)


def test_token_ids_must_come_as_ids() -> None:
    assert token_ids(["token_id:5", "token_id:0"]) == [5, 0]
    with pytest.raises(PathScoreError, match="return_tokens_as_token_ids"):
        token_ids(["token_id:5", "x"])


def test_the_misplaced_chunk_reverses_one_chunk_after_the_first_token() -> None:
    prompt = list(range(600))
    control = misplaced_chunk(prompt)
    assert control[0] == 0 and control[1:1 + CONTROL_CHUNK_TOKENS] == list(
        range(CONTROL_CHUNK_TOKENS, 0, -1))
    assert control[1 + CONTROL_CHUNK_TOKENS:] == prompt[1 + CONTROL_CHUNK_TOKENS:]
    assert misplaced_chunk([7, 1, 2, 3]) == [7, 3, 2, 1]
    with pytest.raises(PathScoreError):
        misplaced_chunk([1, 2])


class EngineStub(BaseHTTPRequestHandler):
    """``/tokenize`` gives 6 tokens; ``/v1/completions`` scores each token ``-token/10``, and
    ``-9`` after a prompt whose second token is not 1 (a misplaced chunk)."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, **body})
        if self.path == "/tokenize":
            reply: dict[str, Any] = {"tokens": [0, 1, 2, 3, 4, 5], "count": 6}
        else:
            ids = body["prompt"]
            wrong = ids[1] != 1
            rows = [None] + [{str(t): {"logprob": -9.0 if wrong and i > 5 else -t / 10,
                                       "rank": 1}} for i, t in enumerate(ids) if i > 0]
            reply = {"choices": [{"prompt_logprobs": rows, "text": ""}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    EngineStub.bodies = []
    with http_stub(EngineStub) as url:
        yield url


def test_scoring_sends_prompt_and_answer_as_ids_and_reads_the_answers_rows(engine_url: str
                                                                           ) -> None:
    out = score_and_judge(engine_url, [{"role": "user", "content": "x"}],
                          ["token_id:7", "token_id:8"], [-0.7, -0.8], prompt_tokens=6,
                          model="tiny", tolerance=TOL)
    assert out["ok"] and out["max_delta"] == pytest.approx(0.0)
    assert out["control_max_delta"] == pytest.approx(9.0 - 0.7)
    tokenize, scored, control = EngineStub.bodies
    assert tokenize["path"] == "/tokenize" and tokenize["add_generation_prompt"] is True
    assert scored["prompt"] == [0, 1, 2, 3, 4, 5, 7, 8] and scored["prompt_logprobs"] == 0
    assert control["prompt"] == [0, 5, 4, 3, 2, 1, 7, 8]


def test_served_logprobs_that_differ_fail_and_a_miscounted_prompt_is_refused(engine_url: str
                                                                             ) -> None:
    out = score_and_judge(engine_url, [], ["token_id:7"], [-0.5], prompt_tokens=6,
                          model="tiny", tolerance=TOL)
    assert not out["ok"] and out["max_delta"] == pytest.approx(0.2)
    with pytest.raises(PathScoreError, match="tokenizes to 6 tokens"):
        score_and_judge(engine_url, [], ["token_id:7"], [-0.7], prompt_tokens=7, model="tiny",
                        tolerance=TOL)
