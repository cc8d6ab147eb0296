"""A dead cache service never stalls serving (failure-model row "cache service down"), and
vLLM and the server each survive the other's SIGKILL, with real processes.

Two tests: the latency bound needs the machine alone (``serial``, one vLLM start); the SIGKILLs
of vLLM and of both share it (three vLLM starts).  vLLM started while the server is down, and
caching once it answers, is :mod:`test_late_attach_e2e`.

Bound: a request sent while the LMCache server is dead completes within the lookup deadline
(5 s) + 2 s + the time the same request takes cold in the same run (it is recomputed).  Before
the connector dropped stores to a server its heartbeat knows is down, such a request waited
33.5 s: LMCache's worker blocked twice for ``mq_timeout`` (15 s) on the dead server.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import ChatResult, VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing import lmcache_log
from kvpersist.testing.helpers import TINY_PINS, wait_for_l2_files, wait_until
from kvpersist.testing.processes import kill_server

pytestmark = pytest.mark.e2e
LOOKUP_DEADLINE_S = 5.0
RESUME_BOUND_S = 45.0  # the first request after the server returns (re-registration included)
HEARTBEATS = 2  # the scheduler's and the worker's (one worker: no tensor parallelism)


def files(root: Path) -> set[str]:
    return {p.name for p in root.glob("*.kvp")}


def wait_new_files(root: Path, before: set[str], timeout: float = 60.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = files(root) - before
        if new:
            return new
        time.sleep(0.5)
    raise AssertionError("no new L2 files: caching did not resume")


@pytest.mark.serial  # bounds a request's latency while the server is down
def test_cache_service_down_never_stalls_serving_and_caching_resumes(
        tiny_model: Path, tmp_path: Path, server_env: dict[str, str],
        settings: ServerSettings) -> None:
    root = settings.cache_root
    vllm = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm.log", server_env)
    latencies: list[float] = []
    try:
        start_server(settings)
        vllm.start()
        base = chat(vllm.base_url, long_conversation(900, "topic A"), timeout=120)
        wait_new_files(root, set())

        # 1. The server dies (SIGKILL) while vLLM serves: requests complete by recompute.
        kill_server(settings)
        for topic in ("topic B", "topic C"):  # B before the heartbeat notices, C after
            began = time.monotonic()
            chat(vllm.base_url, long_conversation(900, topic), timeout=120)
            latencies.append(time.monotonic() - began)
        assert max(latencies) < LOOKUP_DEADLINE_S + 2.0 + base.seconds, (latencies, base.seconds)
        assert vllm.healthy()
        print(f"\nlatencies while the server was down: {[round(x, 2) for x in latencies]}")
        # vLLM's /metrics counts the abandoned lookups by reason (the dashboard's panel)
        wait_until(lambda: metric_sum(vllm.metrics(),
                                      "vllm:kvpersist_lookup_bypasses_total") >= 2,
                   timeout=15, message="no bypass counted in vLLM's /metrics")
        assert metric_sum(vllm.metrics(), "vllm:kvpersist_lookup_bypasses_total",
                          reason="server_down") >= 1

        # 2. The server comes back: caching resumes without restarting vLLM.
        def seen(line: str) -> int:
            return lmcache_log.count(vllm.log_path, line)

        up, registered = seen(lmcache_log.HEALTHY_AGAIN), seen(lmcache_log.REREGISTERED)
        start_server(settings)
        # the heartbeats (2 s) notice, the worker re-registers its KV caches
        wait_until(lambda: seen(lmcache_log.REREGISTERED) > registered
                   and seen(lmcache_log.HEALTHY_AGAIN) >= up + HEARTBEATS, timeout=120,
                   message="vLLM's heartbeats did not recover and re-register")
        before = files(root)
        began = time.monotonic()
        chat(vllm.base_url, long_conversation(900, "topic D"), timeout=120)
        assert time.monotonic() - began < RESUME_BOUND_S
        assert wait_new_files(root, before), "stores did not resume"
    finally:
        vllm.kill()


def same_answer_or_why(vllm: VllmProcess, restored: ChatResult, cold: ChatResult,
                       chat_messages: list[dict[str, str]], hits: float) -> str | None:
    """None when ``restored`` is ``cold`` bit for bit; otherwise what tells a wrong restore
    from an engine that computes differently: the same vLLM answers the chat cold again
    (under a cache salt, so it shares no chunk) and that answer is set beside both."""
    if restored.tokens == cold.tokens and restored.logprobs == cold.logprobs:
        return None
    again_cold = chat(vllm.base_url, chat_messages, timeout=120, cache_salt="diagnosis")
    verdict = ("this vLLM's own cold answer equals the first cold one: the restored KV differs"
               if again_cold.logprobs == cold.logprobs else
               "this vLLM's own cold answer differs from the first cold one too: the engine "
               "computed differently, not the restore")
    return (f"restored answer differs from the cold one ({verdict}); hits {hits:.0f}, "
            f"cached_tokens {restored.cached_tokens}, bypasses "
            f"{metric_sum(vllm.metrics(), 'vllm:kvpersist_lookup_bypasses_total'):.0f}; "
            f"logprobs cold {cold.logprobs[:4]}, restored {restored.logprobs[:4]}, "
            f"cold again {again_cold.logprobs[:4]}")


def test_vllm_and_the_server_each_survive_the_others_sigkill(
        tiny_model: Path, tmp_path: Path, server_env: dict[str, str],
        settings: ServerSettings) -> None:
    """Each restored answer is the cold one bit for bit.  Every full chunk is on disk before
    the first SIGKILL; a restore gets all of them, or one fewer (the allowance this test has
    always had).  A wrong answer names which side differs (:func:`same_answer_or_why`)."""
    root = settings.cache_root
    vllm = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm.log", server_env)
    chat_messages = long_conversation(900, "topic A")
    try:
        start_server(settings)
        vllm.start()
        base = chat(vllm.base_url, chat_messages, timeout=120)
        full_chunks = base.prompt_tokens // 256
        wait_for_l2_files(root, full_chunks)

        # SIGKILL vLLM alone: a new vLLM gets the prefix from L2 (hits > 0), same answer.
        vllm.kill()
        vllm.start()
        again = chat(vllm.base_url, chat_messages, timeout=120)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits >= 256 * (full_chunks - 1) and again.cached_tokens == hits, (hits, again)
        problem = same_answer_or_why(vllm, again, base, chat_messages, hits)
        assert problem is None, problem

        # SIGKILL both: the restart is clean (stale pid file replaced, index rebuilt), and a
        # new vLLM hits L2 with the same answer.
        vllm.kill()
        kill_server(settings)  # returns once the server has exited
        start_server(settings)
        vllm.start()
        warm = chat(vllm.base_url, chat_messages, timeout=120)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits >= 256 * (full_chunks - 1) and warm.cached_tokens == hits, (hits, warm)
        problem = same_answer_or_why(vllm, warm, base, chat_messages, hits)
        assert problem is None, problem
    finally:
        vllm.kill()
