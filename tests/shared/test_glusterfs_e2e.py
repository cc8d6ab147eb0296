"""The same chat on two nodes of one GlusterFS tree, with real vLLM: node A computes and stores
it; node B (its own mount, LMCache server, L1 and vLLM) gets every full chunk from A's part of
the tree, with identical output and logprobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.helpers import (
    TINY_PINS,
    adapter_status,
    l2_files,
    wait_for_l2_files,
    write_pins,
)

from .conftest import Nodes

pytestmark = pytest.mark.e2e
HITS = "vllm:external_prefix_cache_hits_total"
REQUEST_TIMEOUT = 180.0


def test_a_chat_computed_on_node_a_is_restored_on_node_b(tiny_model: Path, tmp_path: Path,
                                                         nodes: Nodes) -> None:
    messages = long_conversation(800)
    start_server(nodes["a"])
    vllm_a = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm-a.log", nodes.env["a"])
    try:
        vllm_a.start()
        cold = chat(vllm_a.base_url, messages, timeout=REQUEST_TIMEOUT)
        chunks = cold.prompt_tokens // 256
        assert chunks >= 2, cold.prompt_tokens
        stored = wait_for_l2_files(nodes["a"].cache_root, chunks)
    finally:
        vllm_a.kill()
    start_server(nodes["b"])
    vllm_b = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm-b.log", nodes.env["b"])
    try:
        vllm_b.start()
        warm = chat(vllm_b.base_url, messages, timeout=REQUEST_TIMEOUT)
        assert metric_sum(vllm_b.metrics(), HITS) == 256 * chunks  # every full chunk from L2
        assert warm.cached_tokens == 256 * chunks
        assert (warm.tokens, warm.logprobs, warm.text) == (cold.tokens, cold.logprobs, cold.text)
        status = adapter_status(nodes["b"])
        assert status["foreign_hits"] >= chunks and status["foreign_failures"] == 0
        # Node B served A's files and wrote no second copy of them.
        assert not set(l2_files(nodes["b"].cache_root, (".kvp",))) & set(stored)
        print(f"\n{chunks} chunks: cold on node a {cold.seconds:.2f}s, from a's part on node b "
              f"{warm.seconds:.2f}s")
    finally:
        vllm_b.kill()


def test_a_tp2_follow_up_chat_is_restored_on_the_other_node_with_every_rank(
        tiny_model: Path, tmp_path: Path, nodes: Nodes) -> None:
    """TP=2 across nodes: node a stores a chat (one file per chunk and rank); node b is asked
    the same chat with a new turn after it.  The new tail is a gap at the end of rank 0's row of
    keys, and rank 1's row follows in LMCache's flattened list: every full chunk of the stored
    chat must still come from a's part for both ranks (it was 0 hits while the first gap ended
    the probing across rows).  The output is bit-identical to the follow-up computed cold on a
    (under a cache salt, so that it shares no chunk with the rest)."""
    pins = write_pins(tmp_path / "pins.env", tensor_parallel_size="2")
    env = {name: {**nodes.env[name], "KVP_SERVER_NICE": "-10" if os.geteuid() == 0 else "0",
                  "VLLM_CPU_OMP_THREADS_BIND": "0|1", "KVP_LOOKUP_TIMEOUT_S": "60", "KVP_HEARTBEAT_S": "10"}
           for name in "ab"}  # see tests/e2e/test_parallel_restore_e2e.py on 2-core TP
    tp2 = ["--tensor-parallel-size", "2", "--no-enable-prefix-caching"]
    stored_chat = long_conversation(800, "a chat on two nodes at tp 2")
    start_server(load_settings(environ=env["a"]))
    vllm_a = VllmProcess(tiny_model, pins, tmp_path / "vllm-a.log", env["a"], extra_args=tp2)
    try:
        vllm_a.start()
        first = chat(vllm_a.base_url, stored_chat, timeout=REQUEST_TIMEOUT)
        chunks = (first.prompt_tokens - 1) // 256
        assert chunks >= 2, first.prompt_tokens
        wait_for_l2_files(nodes["a"].cache_root, 2 * chunks)
        follow_up = [*stored_chat, {"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And what comes next? " * 20}]
        cold = chat(vllm_a.base_url, follow_up, timeout=REQUEST_TIMEOUT, cache_salt="cold")
        assert cold.cached_tokens == 0
    finally:
        vllm_a.kill()
    start_server(load_settings(environ=env["b"]))
    vllm_b = VllmProcess(tiny_model, pins, tmp_path / "vllm-b.log", env["b"], extra_args=tp2)
    try:
        vllm_b.start()
        warm = chat(vllm_b.base_url, follow_up, timeout=REQUEST_TIMEOUT)
        assert warm.prompt_tokens // 256 > chunks  # the new turn adds chunks nobody stored
        assert warm.cached_tokens == 256 * chunks
        assert (warm.tokens, warm.logprobs, warm.text) == (cold.tokens, cold.logprobs, cold.text)
    finally:
        vllm_b.kill()
