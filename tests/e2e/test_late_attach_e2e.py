"""Late attach with real processes: vLLM started before the cache server serves uncached, turns
caching on by itself once the server answers (no vLLM restart), and what it stored then comes
back from L2 after a restart of both."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import TINY_PINS, wait_for_l2_files

pytestmark = pytest.mark.e2e
ATTACHED = "late attach: the LMCache server lists namespace"


def wait_for_log(path: Path, text: str, timeout: float) -> float:
    began = time.monotonic()
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() - began < timeout, f"{text!r} not in {path} within {timeout}s"
        time.sleep(0.5)
    return time.monotonic() - began


def test_vllm_started_first_attaches_when_the_server_comes(
    tiny_model: Path, tmp_path: Path, server_env: dict[str, str], settings: ServerSettings
) -> None:
    root = settings.cache_root
    log = tmp_path / "vllm.log"
    vllm = VllmProcess(tiny_model, TINY_PINS, log, server_env)
    early, later = long_conversation(800, "topic early"), long_conversation(800, "topic later")
    try:
        vllm.start()  # no server yet
        assert "does not answer at start: serving uncached, attaching" in log.read_text()
        before = chat(vllm.base_url, early)
        assert before.cached_tokens == 0 and not root.exists()  # nothing could be stored

        start_server(settings)
        waited = wait_for_log(log, ATTACHED, timeout=90)
        print(f"\nattached {waited:.1f}s after the server answered")
        first = chat(vllm.base_url, later)
        stored = wait_for_l2_files(root, min_count=first.prompt_tokens // 256)
        assert stored, "nothing stored after the late attach"
        vllm.stop()
        stop_server(settings)

        # restart both: the chat stored after the attach comes back from L2
        start_server(settings)
        vllm.start()
        second = chat(vllm.base_url, later)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits >= 256 * len(stored) - 256 and second.cached_tokens == hits, (hits, stored)
        assert second.tokens == first.tokens and second.logprobs == first.logprobs
    finally:
        vllm.kill()
