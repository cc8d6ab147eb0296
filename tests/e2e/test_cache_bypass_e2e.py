"""``KVP_CACHE_BYPASS=1`` with real processes: the connector stays loaded, resolves and records the
identity and says so in vLLM's log, and never looks up or stores; without it, the same stack
stores (the control that shows the test can fail)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.identity.records import list_records
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.helpers import TINY_PINS, adapter_status, l2_files, wait_for_l2_files

pytestmark = pytest.mark.e2e


def test_bypass_keeps_the_connector_and_identity_but_never_caches(
    tiny_model: Path, tmp_path: Path, server_env: dict[str, str], settings: ServerSettings
) -> None:
    root = settings.cache_root
    messages = long_conversation(800)
    start_server(settings)
    log = tmp_path / "vllm-bypass.log"
    vllm = VllmProcess(tiny_model, TINY_PINS, log, {**server_env, "KVP_CACHE_BYPASS": "1"})
    try:
        vllm.start()
        first = chat(vllm.base_url, messages)
        second = chat(vllm.base_url, messages)
        assert first.prompt_tokens >= 700 and second.tokens == first.tokens
        # On purpose, not a condition: a store that must not come has nothing to wait on; had
        # one been sent, it would have landed by now.
        time.sleep(3.0)
        assert l2_files(root) == {}
        assert adapter_status(settings)["stores"] == 0
        assert metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total") == 0
        text = log.read_text(errors="replace")
        assert "KVP_CACHE_BYPASS is on: namespace kvp-" in text
        assert "KvPersistConnector" in text  # the connector is loaded
        namespaces = list(list_records(root))
        assert len(namespaces) == 1 and namespaces[0] in text  # resolved and recorded
    finally:
        vllm.kill()

    # control: the same engine without the bypass stores the chat
    vllm = VllmProcess(tiny_model, TINY_PINS, tmp_path / "vllm.log", server_env)
    try:
        vllm.start()
        chat(vllm.base_url, messages)
        stored = wait_for_l2_files(root, min_count=3)
        assert all(namespaces[0] in name for name in stored)
    finally:
        vllm.kill()
