"""The corruption matrix through real vLLM: whatever happens to an L2 file, the output equals the
clean run's, token for token and logprob for logprob; the damaged file is quarantined and the next
request repairs it.

vLLM runs with its own prefix cache off, so every request asks the connector for the prefix, and
LMCache's L1 is cleared before each request, so the prefix comes from (or fails in) L2.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import ChatResult, VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.corruption import corrupt_file
from kvpersist.testing.helpers import TINY_PINS, adapter_status, clear_l1, wait_for_l2_idle

pytestmark = pytest.mark.e2e


def wait_files(root: Path, count: int, timeout: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(root.glob("*.kvp"))
        if len(files) >= count:
            return files
        assert time.monotonic() < deadline, f"only {len(files)} of {count} L2 files"
        time.sleep(0.5)


def corrupt(files: list[Path], how: str) -> None:
    """Damage every file (``other-key``: each gets the next file's valid content)."""
    originals = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        corrupt_file(f, how, originals[(i + 1) % len(files)] if how == "other-key" else None)


def same(a: ChatResult, b: ChatResult) -> bool:
    return a.tokens == b.tokens and a.logprobs == b.logprobs and a.text == b.text


def test_corruption_matrix_through_vllm(tiny_model: Path, tmp_path: Path,
                                        server_env: dict[str, str],
                                        settings: ServerSettings) -> None:
    root = settings.cache_root
    messages = long_conversation(900)
    vllm = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm.log", server_env,
                       extra_args=["--no-enable-prefix-caching"])
    try:
        start_server(settings)
        vllm.start()
        clean = chat(vllm.base_url, messages)
        n_chunks = clean.prompt_tokens // 256
        wait_files(root, n_chunks)
        clear_l1(settings)
        warm = chat(vllm.base_url, messages)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits == 256 * n_chunks and warm.cached_tokens == hits and same(warm, clean)
        for how in ("noise", "random", "half", "zero", "header", "other-key"):
            files = wait_files(root, n_chunks)
            failures_before = adapter_status(settings)["verify_failures"]
            clear_l1(settings)
            corrupt(files, how)
            damaged = chat(vllm.base_url, messages)
            assert same(damaged, clean), f"{how}: output differs from the clean run"
            status = adapter_status(settings)
            assert status["verify_failures"] > failures_before, how
            hits_before = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
            # the recompute stored good files again (repair): the next request hits L2 fully
            wait_files(root, n_chunks)
            wait_for_l2_idle(settings)  # those stores finished, LMCache took their completion
            clear_l1(settings)
            repaired = chat(vllm.base_url, messages)
            hits_after = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
            assert same(repaired, clean), f"{how}: output after repair differs"
            assert hits_after - hits_before == 256 * n_chunks, f"{how}: not repaired"
            assert repaired.cached_tokens == 256 * n_chunks, f"{how}: restore not used"
        assert adapter_status(settings)["quarantined"] >= 6
    finally:
        vllm.kill()
