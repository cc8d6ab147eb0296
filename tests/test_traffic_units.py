"""The traffic run's own logic, without processes: the population and its prompts, the ideal
LRU replay, the summaries, the answer comparison and the user pool's pause (against a local
HTTP stub standing in for vLLM's streaming API; the real stack is ``tests/e2e/
test_traffic_e2e.py``)."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest

from kvpersist.demo.tiny_model import CHAT_TEMPLATE
from kvpersist.testing.http_stub import http_stub
from kvpersist.testing.traffic.ideal_lru import Access, replay_lru
from kvpersist.testing.traffic.run import compare_answers, pick_sample
from kvpersist.testing.traffic.shape import Population, TrafficShape, pareto_length
from kvpersist.testing.traffic.summary import (
    around_events,
    hit_rates,
    inter_token_latency,
    percentile,
    trend,
    ttft_by_length,
)
from kvpersist.testing.traffic.users import RequestRecord, UserPool


def render(messages: list[dict[str, str]]) -> str:
    """The tiny models' chat template, as vLLM renders it with a generation prompt."""
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, bos_token="<|bos|>",
                                                  add_generation_prompt=True)


def test_each_turn_extends_the_one_before_and_conversations_share_no_prefix() -> None:
    pop = Population.of(TrafficShape(users=2, conversations_per_user=2, min_tokens=300,
                                     max_tokens=900, max_prompt_tokens=2000, seed=3))
    a, b = pop.conversations[0], pop.conversations[1]
    turns = [render(a.messages(k, 160)) for k in range(4)]
    for earlier, later in itertools.pairwise(turns):
        # the prompt up to its generation prompt is where the next turn continues
        assert later.startswith(earlier), (earlier[-80:], later[len(earlier) - 80:][:160])
        assert len(later) > len(earlier)
    first_chunk = lambda text: text[:256]  # noqa: E731
    assert first_chunk(render(a.messages(0, 160))) != first_chunk(render(b.messages(0, 160)))
    # the same shape gives the same prompts (a turn can be asked again later)
    again = Population.of(pop.shape).conversations[0]
    assert render(again.messages(2, 160)) == turns[2]


def test_lengths_are_heavy_tailed_within_their_bounds() -> None:
    rng = random.Random(1)
    lengths = [pareto_length(rng, 1000, 64000, 1.1) for _ in range(5000)]
    assert min(lengths) >= 1000 and max(lengths) <= 64000
    assert percentile(lengths, 50) < 3000  # most chats are short
    assert sum(n > 32000 for n in lengths) > 10  # and a few are near the maximum


def test_popularity_follows_rank_and_retiring_keeps_owner_and_weight() -> None:
    shape = TrafficShape(users=3, conversations_per_user=2, min_tokens=100, max_tokens=200,
                         max_prompt_tokens=600, lora_fraction=0.5, lora_adapters=("x",),
                         seed=1)
    pop = Population.of(shape)
    weights = [c.weight for c in pop.conversations]
    assert weights == sorted(weights, reverse=True)
    assert sorted(r for u in range(3) for r in pop.owned_by(u)) == list(range(6))
    old = pop.conversations[4]
    new = pop.retire(4)
    assert (new.owner, new.weight) == (old.owner, old.weight) and new.cid != old.cid
    assert pop.fits(0, 0) and not pop.fits(0, 10)  # ten turns of 160 tokens do not fit 600


def test_a_shape_that_cannot_hold_its_turns_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        TrafficShape(max_tokens=4000, max_prompt_tokens=4100, turn_tokens=160)
    with pytest.raises(ValueError, match="lora_adapters"):
        TrafficShape(lora_fraction=0.5)


def test_the_ideal_lru_serves_prefixes_and_evicts_the_least_recent() -> None:
    # chunks of 1 byte, 256 tokens; room for 4 chunks
    trace = [Access("a", 3 * 256), Access("a", 3 * 256 + 100), Access("b", 2 * 256),
             Access("a", 4 * 256), Access("b", 2 * 256), Access("c", 5 * 256),
             Access("a", 2 * 256)]
    replay = replay_lru(trace, budget_bytes=4, chunk_bytes=1)
    # a computed; a's 3 chunks hit; b computed (a0 evicted: a1, a2, b0, b1 left);
    # a misses at chunk 0 (then a0-a3 held); b misses (evicted by a); c is bigger than the
    # cache (its last 4 chunks stay); a misses.
    assert replay.hit_tokens == [0, 3 * 256, 0, 0, 0, 0, 0]
    assert replay.hit_rate(a.prompt_tokens for a in trace) == pytest.approx(
        768 / sum(a.prompt_tokens for a in trace))
    roomy = replay_lru(trace, budget_bytes=100, chunk_bytes=1)
    assert roomy.hit_tokens == [0, 768, 0, 768, 512, 0, 512]


def record(seq: int, started: float, prompt: int, cached: int, *, ttft: float = 0.1,
           times: tuple[float, ...] = (), error: str | None = None,
           conversation: str = "a") -> RequestRecord:
    return RequestRecord(seq, 0, conversation, 0, started, prompt, cached, ttft, 1.0,
                         ("x",), (-1.0,), times, error)


def test_hit_rates_are_windowed_and_failures_left_out() -> None:
    records = [record(0, 1.0, 512, 0), record(1, 2.0, 512, 512),
               record(2, 11.0, 768, 512, conversation="a"),
               record(3, 12.0, 999, 0, error="boom")]
    out = hit_rates(records, window_s=10.0, chunk_bytes=1, budgets={"lru": 10})
    assert out["overall"]["measured"] == pytest.approx(1024 / 1792)
    assert [w["t_s"] for w in out["windows"]] == [0.0, 10.0]
    assert out["windows"][0]["measured"] == pytest.approx(0.5)
    assert out["windows"][0]["lru"] == pytest.approx(0.5)
    assert out["windows"][1]["lru"] == pytest.approx(512 / 768)


def test_the_hit_rate_around_an_action_leaves_out_its_own_time_and_failures() -> None:
    records = [record(0, 5.0, 1000, 800), record(1, 9.0, 1000, 600),
               record(2, 12.0, 1000, 1000),  # during the action (10-15 s): in neither side
               record(3, 16.0, 1000, 200), record(4, 18.0, 500, 0, error="boom"),
               record(5, 40.0, 1000, 1000)]  # past the span after it
    out = around_events(records, [{"t_s": 10.0, "action": "cleanup", "seconds": 5.0},
                                  {"t_s": 100.0, "action": "scrub", "seconds": 1.0}],
                        span_s=10.0)
    assert out[0]["before"] == {"requests": 2, "hit_rate": pytest.approx(0.7)}
    assert out[0]["after"] == {"requests": 1, "hit_rate": pytest.approx(0.2)}
    assert out[1]["before"] == {"requests": 0, "hit_rate": None}


def test_ttft_tables_split_hits_from_misses_by_length() -> None:
    rows = ttft_by_length([record(0, 0, 1000, 0, ttft=2.0), record(1, 0, 1000, 512, ttft=0.5),
                           record(2, 0, 5000, 4096, ttft=0.7)])
    assert rows[0]["tokens"] == [0, 2048]
    assert rows[0]["hits"]["p50"] == 0.5 and rows[0]["misses"]["p50"] == 2.0
    assert rows[1]["tokens"] == [2048, 8192] and rows[1]["misses"]["n"] == 0
    assert rows[1]["misses"]["p50"] is None


def test_inter_token_gaps_are_split_by_a_concurrent_long_restore() -> None:
    restore = record(0, 10.0, 9000, 8192, ttft=5.0, times=(5.0,))  # restoring 10 s .. 15 s
    stream = record(1, 8.0, 300, 0, times=(1.0, 2.0, 3.0, 8.0, 8.5))  # at 9, 10, 11, 16, 16.5
    out = inter_token_latency([restore, stream], restore_tokens=4096)
    assert out["restores"] == 1
    assert out["during_restores"]["n"] == 2  # 10->11 and 11->16 overlap 10..15
    assert out["otherwise"]["n"] == 2  # 9->10 touches it only at its end; 16->16.5 after it
    assert out["during_restores"]["p99"] == pytest.approx(5.0)


def test_trend_compares_after_warm_up_with_the_end() -> None:
    flat = [{"k": 100} for _ in range(40)]
    growing = [{"k": 100 + 10 * i} for i in range(40)]
    assert trend(flat, "k")["ratio"] == 1.0
    assert trend(growing, "k")["ratio"] > 1.5
    assert trend(flat[:3], "k")["ratio"] is None  # too few samples to say


def test_the_answer_check_fails_on_a_changed_logprob_or_token() -> None:
    first = RequestRecord(0, 0, "a", 0, 0.0, 600, 512, 0.1, 1.0, ("x", "y"), (-1.0, -2.0))
    same = SimpleNamespace(tokens=["x", "y"], logprobs=[-1.0, -2.0])
    close = SimpleNamespace(tokens=["x", "y"], logprobs=[-1.0, -2.0 + 1e-6])
    other = SimpleNamespace(tokens=["x", "z"], logprobs=[-1.0, -2.0])
    passed, failed = {"ok": True}, {"ok": False}
    assert compare_answers(first, same, failed, exact=True)["ok"]
    assert not compare_answers(first, close, passed, exact=True)["ok"]
    # batched: the served tokens' own scores decide, wherever the greedy paths went
    assert compare_answers(first, close, passed, exact=False)["ok"]
    assert not compare_answers(first, same, failed, exact=False)["ok"]
    parted = compare_answers(first, other, {"ok": True, "scores": [-1.0, -2.0 - 3e-4]},
                             exact=False)
    assert parted["ok"] and not parted["same_tokens"]
    assert parted["gap_at_divergence"] == pytest.approx(3e-4)  # served y against cold z
    assert parted["diverged_at"] == 1 and parted["max_delta_up_to_divergence"] == 0.0
    assert parted["cold"]["tokens"] == ["x", "z"] and parted["served"]["tokens"] == ["x", "y"]
    assert not compare_answers(first, other, {"error": "no scores"}, exact=False)["ok"]


def test_the_sample_prefers_hits_spread_over_the_run() -> None:
    records = [record(i, float(i), 1000, 512 if i % 2 else 0) for i in range(40)]
    chosen = pick_sample(records, 8)
    assert len(chosen) == 8
    assert sum(r.cached_tokens > 0 for r in chosen) == 6
    assert max(r.started_s for r in chosen) - min(r.started_s for r in chosen) > 20


class StreamStub(BaseHTTPRequestHandler):
    """vLLM's streamed chat answer: two tokens after ``delay`` seconds."""

    delay = 0.3

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(type(self).delay)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in ({"choices": [{"delta": {"content": "hi"}, "logprobs": {"content": [
                          {"token": "h", "logprob": -0.5}, {"token": "i", "logprob": -0.25}]}}]},
                      {"choices": [], "usage": {"prompt_tokens": 300,
                                                "prompt_tokens_details": {"cached_tokens": 256}}}):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_url() -> Iterator[str]:
    with http_stub(StreamStub) as url:
        yield url


def test_a_paused_pool_has_nothing_in_flight_and_resumes_elsewhere(stub_url: str) -> None:
    shape = TrafficShape(users=3, conversations_per_user=1, min_tokens=100, max_tokens=200,
                         max_prompt_tokens=2000, think_s=0.0)
    pool = UserPool(shape, stub_url, "tiny")
    pool.start()
    time.sleep(0.5)
    pool.pause()
    assert pool._in_flight == 0
    paused_at = len(pool.records)
    time.sleep(0.5)
    assert len(pool.records) == paused_at  # nothing sent while paused
    pool.resume(stub_url)
    time.sleep(0.5)
    pool.stop()
    assert len(pool.records) > paused_at
    assert all(r.error is None for r in pool.records)
    assert all(r.tokens == ("h", "i") and r.cached_tokens == 256 for r in pool.records)
    turns = {r.turn for r in pool.records}
    assert turns >= {0, 1}  # each success advanced its conversation


def test_a_failed_request_is_recorded_and_its_turn_asked_again() -> None:
    shape = TrafficShape(users=1, conversations_per_user=1, min_tokens=100, max_tokens=200,
                         max_prompt_tokens=2000, think_s=0.0)
    pool = UserPool(shape, "http://127.0.0.1:9", "tiny", request_timeout_s=2.0)
    pool.start()
    time.sleep(0.3)
    pool.stop()
    assert pool.records and all(r.error for r in pool.records)
    assert {r.turn for r in pool.records} == {0}
