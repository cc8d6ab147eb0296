"""A lookup the connector gives up frees what it holds: the next restores are served at once,
not after LMCache's 300 s read-lock TTL.  Real vLLM and a real LMCache server.

L1 is 4 chunks of 16 MiB and a streamed window 2 (half of L1, the most allowed).  Two
conversations of 8 full chunks are stored cold.  With L1 emptied, both are asked for at once
while the server's L2 loads are held (``KVP_FAULT_HOLD_L2_LOADS_WHILE``, test-only): each
lookup reserves its first window, 2 chunks, so L1 is full, and nothing moves, so after
``kvpersist.lookup_timeout_s`` (5 s) the connector bypasses both and they are computed cold.
Then the loads are let go.  Without the release the two abandoned prefetches keep all of L1
read-locked, nothing can be evicted, and the next restore of either conversation gets at most
its 2 chunks already in L1.  With it, each abandoned job is settled when its load lands, and
both conversations come back in full, bit-identical, right after.

vLLM's own prefix cache is off, so every hit counted is kvpersist's."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import ChatResult, VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import fault_injection
from kvpersist.testing.fault_server import FAULT_ENTRY
from kvpersist.testing.helpers import (
    clear_l1,
    l2_files,
    pins_for_model,
    server_env,
    wait_for_l2_files,
    wait_until,
)

pytestmark = pytest.mark.e2e
CHUNK = 256
TOKENS = 2000  # 8 full chunks (2150 prompt tokens)
MAX_LEN = 4096
TIMEOUT = 600.0
TOPICS = ("an abandoned chat", "another abandoned chat")


@dataclass
class Stack:
    settings: ServerSettings
    vllm: VllmProcess
    hold: Path
    cold: dict[str, ChatResult]


def server_counter(settings: ServerSettings, name: str) -> float:
    text = http.get(settings.http_url + "/metrics", timeout=10).body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, wide_kv_model: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("abandoned")
    model = wide_kv_model
    pins = pins_for_model(model, tmp / "wide.env", max_model_len=MAX_LEN)
    env = server_env(tmp / "cache", KVP_L1_SIZE_GB="0.07", KVP_RESTORE_WINDOW_GB="0.035")
    settings = load_settings(env)
    hold = tmp / "hold-loads"
    vllm = VllmProcess(model, pins, tmp / "vllm.log", env, max_model_len=MAX_LEN,
                       extra_args=["--no-enable-prefix-caching"])
    start_server(settings, env={**os.environ, fault_injection.HOLD_LOADS_WHILE: str(hold)},
                 entry=FAULT_ENTRY)
    try:
        vllm.start()
        cold: dict[str, ChatResult] = {}
        for topic in TOPICS:
            before = len(l2_files(settings.cache_root))
            for _ in range(3):  # a store that found L1 full of chunks on their way is dropped
                cold[topic] = chat(vllm.base_url, long_conversation(TOKENS, topic),
                                   timeout=TIMEOUT)
                try:
                    wait_for_l2_files(settings.cache_root, before + 8, timeout=30)
                    break
                except AssertionError:
                    continue
            assert cold[topic].prompt_tokens // CHUNK == 8
        wait_for_l2_files(settings.cache_root, 16, timeout=60)
        # counted since the server started, which stored all of them
        assert server_counter(settings, "kvpersist_l2_stores_total") >= 16
        yield Stack(settings, vllm, hold, cold)
    finally:
        vllm.kill()
        stop_server(settings)


def ask_both(stack: Stack) -> dict[str, ChatResult]:
    results: dict[str, ChatResult] = {}

    def run(topic: str) -> None:
        results[topic] = chat(stack.vllm.base_url, long_conversation(TOKENS, topic),
                              timeout=TIMEOUT)

    threads = [threading.Thread(target=run, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert set(results) == set(TOPICS)
    return results


def test_the_next_restores_after_two_bypassed_lookups_are_served_in_full(stack: Stack) -> None:
    clear_l1(stack.settings)
    bypasses = metric_sum(stack.vllm.metrics(), "vllm:kvpersist_lookup_bypasses_total")
    released = server_counter(stack.settings, "kvpersist_restore_released_abandoned_total")
    stack.hold.write_text("held\n")
    try:
        bypassed = ask_both(stack)
    finally:
        stack.hold.unlink()
    let_go = time.monotonic()
    for topic in TOPICS:
        assert bypassed[topic].cached_tokens == 0, topic
        assert bypassed[topic].tokens == stack.cold[topic].tokens, topic
    assert metric_sum(stack.vllm.metrics(),
                      "vllm:kvpersist_lookup_bypasses_total") >= bypasses + 2
    # Each abandoned prefetch is settled when its held load lands (seconds, not the TTL).
    wait_until(lambda: server_counter(stack.settings,
                                      "kvpersist_restore_released_abandoned_total")
               >= released + 2, timeout=60)
    for topic in TOPICS:
        warm = chat(stack.vllm.base_url, long_conversation(TOKENS, topic), timeout=TIMEOUT)
        assert warm.cached_tokens == 8 * CHUNK, (topic, warm.cached_tokens)
        cold = stack.cold[topic]
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs), topic
    print(f"\nboth restores served in full {time.monotonic() - let_go:.1f} s after the "
          "abandoned loads were let go (LMCache's read-lock TTL: 300 s)")
