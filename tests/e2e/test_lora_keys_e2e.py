"""LoRA requests hit only KV computed with the same adapter, by content, across restarts.

Real processes: the LMCache MP server with kvpersist's L2, and vLLM (CPU) serving the tiny model
with two random adapters that change K and V (``--enable-lora``), vLLM's own prefix cache off so
that every repeat is an LMCache lookup.  The first engine computes each of adapter a, adapter b
and the base model cold (``cached_tokens`` 0: none of them may hit another's KV) and then hits
its own KV; ``kvp-admin report`` names the adapter of each file; after restarting both processes
adapter a's chat comes back from L2 bit-identical.
The probe can fail: the two adapters' cold answers differ from each other and from the base's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.serving.connector.request_keys import RESERVED_PREFIX
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import TINY_PINS, l2_files, wait_for_l2_files
from kvpersist.testing.lora import build_random_lora

pytestmark = pytest.mark.e2e
CHUNK = 256


def lora_engine(tiny_model: Path, adapters: dict[str, Path], log: Path,
                server_env: dict[str, str]) -> VllmProcess:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return VllmProcess(tiny_model, TINY_PINS, log, server_env, extra_args=[
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--no-enable-prefix-caching", "--lora-modules", *modules])


def test_adapters_never_share_kv_and_come_back_from_l2(
        tiny_model: Path, tmp_path: Path, server_env: dict[str, str],
        settings: ServerSettings) -> None:
    adapters = {"a": build_random_lora(tmp_path / "lora-a", seed=1),
                "b": build_random_lora(tmp_path / "lora-b", seed=2)}
    messages = long_conversation(900, topic="adapters")
    full = lambda tokens: tokens // CHUNK * CHUNK  # noqa: E731

    start_server(settings)
    vllm = lora_engine(tiny_model, adapters, tmp_path / "vllm-1.log", server_env)
    try:
        vllm.start()
        cold = {}
        for stored, model in enumerate(("a", "b", "tiny"), start=1):
            cold[model] = chat(vllm.base_url, messages, model=model)
            # computed, not served another's KV (what was asked before is stored first)
            assert cold[model].cached_tokens == 0, (model, cold[model])
            wait_for_l2_files(settings.cache_root, stored * (cold[model].prompt_tokens // CHUNK))
        prompt = cold["a"].prompt_tokens
        assert prompt >= 3 * CHUNK
        for model, result in cold.items():  # shown with -s: the probe's three cold answers
            print(f"cold {model}: {result.text!r} first logprobs {result.logprobs[:2]}")
        # the probe can fail: the three computations give different answers
        assert cold["a"].logprobs != cold["b"].logprobs
        assert cold["a"].logprobs != cold["tiny"].logprobs
        assert cold["b"].logprobs != cold["tiny"].logprobs
        for model in ("b", "a"):  # each hits its own KV (vLLM's prefix cache is off)
            again = chat(vllm.base_url, messages, model=model)
            assert again.cached_tokens == full(prompt - 1), (model, again)
            assert (again.tokens, again.logprobs) == (cold[model].tokens, cold[model].logprobs)
    finally:
        vllm.kill()
    files = l2_files(settings.cache_root)
    salts = {name.split("@", 1)[1].removesuffix(".kvp") for name in files if "@" in name}
    assert len(salts) == 2 and all(s.startswith(RESERVED_PREFIX + "lora") for s in salts)
    assert sum("@" not in name for name in files) == full(prompt - 1) // CHUNK  # the base's
    # kvp-admin says which adapter each namespace's files belong to
    report = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "report", "--json"],
                            env={**os.environ, **server_env}, capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0, report.stderr
    (row,) = json.loads(report.stdout)["namespaces"]
    assert sorted(a["names"] for a in row["lora_adapters"].values()) == [["a"], ["b"]]
    stop_server(settings)

    # both processes restarted: adapter a's chat comes back from L2, bit-identical
    start_server(settings)
    vllm = lora_engine(tiny_model, adapters, tmp_path / "vllm-2.log", server_env)
    try:
        vllm.start()
        restored = chat(vllm.base_url, messages, model="a")
        assert restored.cached_tokens == full(prompt - 1), restored
        assert (restored.tokens, restored.logprobs) == (cold["a"].tokens, cold["a"].logprobs)
        base = chat(vllm.base_url, messages, model="tiny")
        assert (base.tokens, base.logprobs) == (cold["tiny"].tokens, cold["tiny"].logprobs)
    finally:
        vllm.kill()
