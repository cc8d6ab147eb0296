"""Disk full under real vLLM: the L2 tier lives on a 3 MiB tmpfs (about 11 chunk files of the tiny
model) under a 2 GiB budget, so ENOSPC, not the budget, stops the stores.  vLLM keeps answering,
and every answer equals the one it gave before: from L2 where a chunk fit, recomputed where not."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.l2.files import verify_file
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import TINY_PINS, adapter_status, clear_l1, wait_for_l2_idle
from kvpersist.testing.helpers import server_env as make_server_env

pytestmark = pytest.mark.e2e


def test_disk_full_vllm_keeps_answering_correctly(tiny_model: Path, tmp_path: Path,
                                                  small_fs: Path) -> None:
    env = make_server_env(small_fs / "cache")
    settings = load_settings(env)
    vllm = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm.log", env,
                       extra_args=["--no-enable-prefix-caching"])
    topics = [f"disk topic {i}" for i in range(6)]  # 6 × 3 chunks ≫ 11 files
    try:
        start_server(settings)
        vllm.start()
        first = {t: chat(vllm.base_url, long_conversation(900, t)) for t in topics}
        # every full chunk of the six prompts answered by the adapter (written or refused)
        chunks = sum((r.prompt_tokens - 1) // 256 for r in first.values())
        status = wait_for_l2_idle(settings, stores_at_least=chunks)
        assert status["rejected_disk_full"] > 0, status
        root = settings.cache_root
        assert not [p for p in root.iterdir() if ".tmp." in p.name]
        stored = list(root.glob("*.kvp"))
        assert stored and all(verify_file(p)[0] is None for p in stored)
        assert status["used_bytes"] == sum(p.stat().st_size for p in stored)
        clear_l1(settings)
        for t in topics:
            again = chat(vllm.base_url, long_conversation(900, t))
            assert again.tokens == first[t].tokens and again.logprobs == first[t].logprobs, t
        assert adapter_status(settings)["load_hits"] > 0  # what fit was served from L2
        assert vllm.healthy()
    finally:
        vllm.kill()
        stop_server(settings)
