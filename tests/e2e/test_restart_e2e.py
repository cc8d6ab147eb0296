"""The mission, end to end with real processes: LMCache MP server + vLLM (CPU) + tiny model.

A long chat stores chunks in L2 under the namespace; after restarting *both* processes the same
chat gets its prefix from L2 with identical output and logprobs; a changed identity field gives a
new namespace with no hits and leaves the old files untouched.  The chat carries a unique marker
string that must appear in no log, record or tool output the stack wrote: only the KV payloads
(numbers, not text) are derived from the prompt.

Names users choose ride along: the model is a local folder outside the Hugging Face cache layout
pinned as ``team--x/chat--v2`` (a model id with ``--``, which earlier versions' file names could
not tell from ``team/x/chat/v2``), and two more chats carry a salt with ``.tmp.`` in it and a
120-character salt; each comes back in full after both restarts, and ``kvp-admin verify
--check`` finds the stopped tree consistent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.identity import load_pins, merge_sources
from kvpersist.identity.fields import NO_DRAFT
from kvpersist.identity.records import list_records
from kvpersist.identity.sources import build_identity, from_model_folder
from kvpersist.l2.layout import sanitize_model_name
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import l2_files, wait_for_l2_files, write_pins

pytestmark = pytest.mark.e2e
REQUEST_TIMEOUT = 120.0


def expected_namespace(model_dir: Path, pins_path: Path, **live: object) -> str:
    fields: dict[str, object] = dict(from_model_folder(model_dir))
    fields.update(live)
    fields["connector"] = "LMCacheMPConnector"
    fields["build"] = build_identity()
    fields["draft_sha256"] = NO_DRAFT  # the engine's own field: no speculative decoding here
    res = merge_sources(load_pins(pins_path), fields)
    assert res.enabled, res.problems
    assert res.identity is not None
    return res.identity.namespace


ADMIN_OUTPUTS: list[str] = []  # every kvp-admin stdout/stderr of this module, for the marker scan


def admin_json(env: dict[str, str], *argv: str) -> dict[str, Any]:
    """``kvp-admin ARGV --json`` against the test's server and cache root."""
    res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", *argv, "--json"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    ADMIN_OUTPUTS.extend((res.stdout, res.stderr))
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def files_containing(top: Path, needle: bytes, *, skip_suffix: str = ".kvp") -> list[Path]:
    """Regular files under ``top`` whose bytes contain ``needle`` (KV payloads skipped)."""
    return [p for p in sorted(top.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.suffix != skip_suffix
            and needle in p.read_bytes()]


def lmcache_metric(settings: ServerSettings, name: str) -> float:
    body = http.get(settings.http_url + "/metrics", timeout=10).body
    return metric_sum(body.decode(), name)


#: A model id and salts whose file names earlier versions got wrong (issue 35's chats).
MODEL_ID = "team--x/chat--v2"
SALTS = ("team.tmp.a", "s" * 120)


def test_prefix_survives_restart_of_both_and_identity_change_isolates(
    tiny_model: Path, tmp_path: Path, server_env: dict[str, str], settings: ServerSettings
) -> None:
    root = settings.cache_root
    marker = f"kvp-secret-{uuid.uuid4().hex[:16]}"
    messages = long_conversation(800)
    messages[0]["content"] += f" Case {marker}."
    salted = [long_conversation(300, f"salted {i}") for i in range(len(SALTS))]
    # A local folder outside the Hugging Face cache layout: the pins name the model.
    folder = Path(shutil.copytree(tiny_model, tmp_path / "chat-v2"))  # a copy: links resolve
    pins = write_pins(tmp_path / "pins.env", model_id=MODEL_ID, tokenizer_id=MODEL_ID)
    # vLLM's default compilation (the other end-to-end tests run eagerly): the one that
    # production runs restores into a compiled model identically too.
    vllm = VllmProcess(folder, pins, tmp_path / "vllm.log", server_env, compile=True)
    namespace = expected_namespace(folder, pins, block_size=128, tensor_parallel_size=1,
                                   pipeline_parallel_size=1)
    prefix = f"{sanitize_model_name(f'{MODEL_ID}/{namespace}')}_"
    assert prefix.startswith("%team--x%2Fchat--v2%2Fkvp-"), prefix
    try:
        # Round 1: cold. The prompt is computed and its full chunks are stored in L2.
        start_server(settings)
        vllm.start()
        first = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
        assert first.prompt_tokens >= 700
        salted_first = [chat(vllm.base_url, m, timeout=REQUEST_TIMEOUT, cache_salt=salt)
                        for m, salt in zip(salted, SALTS, strict=True)]
        salted_chunks = sum(c.prompt_tokens // 256 for c in salted_first)
        assert salted_chunks >= len(SALTS)
        stored = wait_for_l2_files(root, min_count=first.prompt_tokens // 256 + salted_chunks)
        assert stored, "no L2 files after the first request"
        assert all(name.startswith(prefix) for name in stored), (prefix, list(stored))
        assert len([n for n in stored if "@team.tmp.a" in n]) >= 1  # a live file, not a temp
        assert len([n for n in stored if "@%h" in n]) >= 1  # the long salt, hashed
        assert metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total") == 0
        assert first.cached_tokens == 0
        vllm.stop()
        stop_server(settings)

        # Round 2: restart BOTH processes; the prefix comes back from L2.
        start_server(settings)
        vllm.start()
        for m, salt, before in zip(salted, SALTS, salted_first, strict=True):
            again = chat(vllm.base_url, m, timeout=REQUEST_TIMEOUT, cache_salt=salt)
            assert again.cached_tokens == (before.prompt_tokens - 1) // 256 * 256, salt
            assert again.tokens == before.tokens and again.logprobs == before.logprobs
        salted_hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        second = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total") - salted_hits
        l2_hits = lmcache_metric(settings, "lmcache_mp_lookup_hit_l2_tokens_total")
        unsalted = [n for n in stored if "@" not in n]  # the long chat's own chunks
        assert hits >= 256 * len(unsalted) - 256, (hits, len(unsalted))
        assert l2_hits > 0
        # The client sees the restore (the launcher turns on prompt-token details).
        assert second.cached_tokens == hits, (second.cached_tokens, hits)
        assert second.tokens == first.tokens
        assert second.logprobs == first.logprobs
        assert second.text == first.text
        vllm.stop()
        before_change = l2_files(root)

        # Round 3: one identity field changes (max model length, pinned and live together):
        # a new namespace, no external hits, and the old files untouched.
        changed_pins = write_pins(tmp_path / "changed.env", max_model_len="1024",
                                  model_id=MODEL_ID, tokenizer_id=MODEL_ID)
        new_namespace = expected_namespace(folder, changed_pins, block_size=128,
                                           tensor_parallel_size=1, pipeline_parallel_size=1,
                                           max_model_len=1024)
        assert new_namespace != namespace
        # eager: compilation is not an identity field, and the compiled restore is round 2's
        vllm_changed = VllmProcess(folder, changed_pins, tmp_path / "vllm-changed.log",
                                   server_env, extra_args=["--max-model-len", "1024"])
        vllm = vllm_changed
        vllm.start()
        third = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
        assert metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total") == 0
        # Computed afresh: the same greedy tokens, up to the shorter room the 1024-token limit
        # leaves after this ~1000-token prompt.
        assert third.tokens and third.tokens == first.tokens[: len(third.tokens)]
        after = wait_for_l2_files(root, min_count=len(before_change) + 1)
        for name, digest in before_change.items():
            assert after.get(name) == digest, f"old file {name} changed or vanished"
        new_files = set(after) - set(before_change)
        assert new_files and all(new_namespace in n for n in new_files), new_files

        # "Why no hits?" answered from what is on disk: each engine recorded its identity under
        # the cache root, and kvp-admin names the one field that keeps the namespaces apart.
        engines = {e["namespace"]: e for e in
                   admin_json(server_env, "identity", "server")["engines"]}
        assert engines[new_namespace]["fields"]["max_model_len"] == 1024, engines
        diff = admin_json(server_env, "identity", "diff", namespace, new_namespace)
        assert [d["field"] for d in diff["differences"]] == ["max_model_len"], diff
        admin_json(server_env, "report")
        admin_json(server_env, "verify")
    finally:
        vllm.kill()
    stop_server(settings)
    check = admin_json(server_env, "verify", "--check")  # the stopped tree, as the server sees it
    assert check["problems"] == [] and check["files"] == len(l2_files(root)), check

    # No prompt text anywhere but the KV payloads: server log, vLLM logs, identity records,
    # kvp-admin output.  The scan can find the marker: the prompt the test sent contains it.
    assert marker in json.dumps(messages)
    written = [settings.log_file, tmp_path / "vllm.log", tmp_path / "vllm-changed.log"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in written), written
    assert len(list_records(root)) == 2, "the identity records the scan must cover are missing"
    assert files_containing(tmp_path, marker.encode()) == []
    assert [o for o in ADMIN_OUTPUTS if marker in o] == []
