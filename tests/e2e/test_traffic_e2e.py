"""A short day of traffic (the CI version of ``benchmarks/bench_traffic.py``): simulated users
return to their chats through real vLLM and a real cache server whose L2 budget is a fraction
of the working set, while the server restarts, a cleanup deletes half the tier and a scrub
reads all of it.  Nothing fails, nothing is wrong, the accounting holds.

One run is shared by the tests below; each states one claim about it.  vLLM runs one sequence
at a time, so every sampled answer must equal the cold one bit for bit
(:mod:`kvpersist.testing.traffic.run`)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpersist.demo.tiny_model import TRAFFIC, build_tiny_model
from kvpersist.testing.helpers import pins_for_model
from kvpersist.testing.traffic.run import StackSpec, TrafficPlan, run_traffic
from kvpersist.testing.traffic.shape import TrafficShape

pytestmark = pytest.mark.e2e
MAX_LEN = 8192
#: A few users, chats of 512 to 3,072 tokens (1 MiB of KV per 256-token chunk), an L2 budget of
#: 24 MiB against a working set of about 60 chunks, and 80 s of traffic.
SHAPE = TrafficShape(users=4, conversations_per_user=2, min_tokens=512, max_tokens=3072,
                     turn_tokens=160, max_prompt_tokens=MAX_LEN - 64, think_s=0.5,
                     salted_fraction=0.25, seed=7)
PLAN = TrafficPlan(SHAPE, duration_s=80.0,
                   events=((20.0, "restart-server"), (45.0, "cleanup"), (60.0, "scrub")),
                   sample_interval_s=2.0, window_s=20.0, wrong_answer_sample=6,
                   restore_tokens=1024)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("traffic")
    model = build_tiny_model(tmp / "models", TRAFFIC)
    spec = StackSpec(model, pins_for_model(model, tmp / "pins.env", max_model_len=MAX_LEN),
                     tmp, l1_gb="0.03", budget_gb="0.024", max_model_len=MAX_LEN)
    result = run_traffic(spec, PLAN)
    assert "check_error" not in result and "l2_not_idle" not in result, result.get(
        "check_error", result.get("l2_not_idle"))
    return result


def test_no_request_fails_while_the_server_restarts_and_operators_act(run: dict[str, Any]
                                                                       ) -> None:
    assert run["requests"] >= 20, run["requests"]
    assert run["failed"] == 0, run["failures"]
    assert [e["action"] for e in run["events"]] == ["restart-server", "cleanup", "scrub"]
    errors = [e for e in run["events"] if "error" in e]
    assert not errors, errors
    cleanup = next(e for e in run["events"] if e["action"] == "cleanup")["result"]
    assert cleanup["deleted_files"] > 0 and cleanup["via_server"] == cleanup["deleted_files"]
    scrub = next(e for e in run["events"] if e["action"] == "scrub")["result"]
    assert scrub["checked"] > 0 and scrub["failures"] == 0, scrub


def test_answers_served_from_the_cache_equal_the_cold_ones_bit_for_bit(run: dict[str, Any]
                                                                        ) -> None:
    sample = run["wrong_answer_sample"]
    assert sample["exact"]
    assert sample["asked"] == PLAN.wrong_answer_sample
    assert sample["wrong"] == 0, [a for a in sample["answers"] if not a["ok"]]
    # the sample holds answers a wrong cache could have spoilt
    assert sum(a["cached_tokens"] > 0 for a in sample["answers"]) >= 3, sample["answers"]


def test_each_sampled_answers_own_tokens_scored_cold_match_and_a_misplaced_chunk_shows(
        run: dict[str, Any]) -> None:
    """The check batched runs rely on (:mod:`kvpersist.testing.traffic.path_scores`), on the
    real engine: each sampled answer's own tokens, scored by the bypass engine in one prefill,
    have the logprobs they were served with (within the tolerance: a prefill and a decode step
    round differently), and the same tokens after the prompt's first chunk reversed move by
    far more, so the comparison would see a wrong chunk."""
    sample = run["wrong_answer_sample"]
    assert sample["unscored"] == 0, [a["scored"] for a in sample["answers"]]
    for answer in sample["answers"]:
        scored = answer["scored"]
        assert scored["ok"] and not scored["blind"], scored
        assert scored["control_max_delta"] > 0.1, scored


def test_the_tier_evicts_at_its_budget_and_still_serves_hits(run: dict[str, Any]) -> None:
    assert run["tier_at_end"]["evicted"] > 0, run["tier_at_end"]
    assert run["tier_at_end"]["used_bytes"] <= 0.024 * (1 << 30)
    overall = run["hit_rate"]["overall"]
    assert overall["measured"] > 0, overall
    # the ideal LRU is replayed on the same requests: a bigger budget never serves less
    assert (overall["ideal_lru_at_reclaim_target"] <= overall["ideal_lru_at_budget"]
            <= overall["ideal_lru_at_l1_plus_budget"]), overall
    assert run["samples"] and all("server_threads" in s for s in run["samples"][-3:])


def test_the_stopped_tree_is_consistent_and_nothing_of_ours_runs(run: dict[str, Any]) -> None:
    check = run["verify_check"]
    assert check["exit"] == 0 and check["problems"] == [], check
    assert check["files"] == run["tier_at_end"]["files"]
    assert check["bytes"] == run["tier_at_end"]["used_bytes"]
    assert run["left_behind"]["processes"] == []



def test_the_server_lets_go_of_a_stopped_engines_kv_cache(run: dict[str, Any]) -> None:
    """The serving engine stopped, the server keeps no mapping of its KV segment (LMCache
    0.5.6 alone kept every engine's mapping until it exited: lmcache_compat.engine_release)."""
    seen = run["server_kv_mappings_after_engine_stop"]
    assert seen["mapped_before"], seen  # the engine's cache was mapped while it served
    assert seen["released_within_s"] is not None, seen


def test_the_bypass_engine_keeps_the_connector_and_identity_but_never_caches(
        run: dict[str, Any]) -> None:
    """``KVP_CACHE_BYPASS=1`` (the engine the sample is asked of, on the same server and tree):
    the connector stays loaded, resolves and records the identity, says so in vLLM's log, and
    neither looks up nor stores.  The serving engine before it stored and hit on the same
    stack (the control that shows this can fail)."""
    bypass = run["bypass_engine"]
    assert bypass["stores"] == 0 and bypass["external_hits"] == 0, bypass
    assert bypass["says_bypass"] and bypass["connector_loaded"], bypass
    assert bypass["namespace_logged"] in bypass["namespaces_recorded"], bypass
    assert run["tier_at_end"]["files"] > 0 and run["hit_rate"]["overall"]["measured"] > 0
