"""The same chat on two nodes of one GlusterFS tree, with real vLLM: node A computes and stores
it; node B (its own mount, LMCache server, L1 and vLLM) gets every full chunk from A's part of
the tree, with identical output and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server import start_server
from kvpersist.testing.helpers import TINY_PINS, adapter_status, l2_files, wait_for_l2_files

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
