"""KV produced faster than L2 absorbs it: what L1 cannot take is counted, never half-written.

LMCache skips the chunks of a STORE it cannot reserve in L1 and answers success, so the engine
believes them stored.  A real server (no vLLM: the synthetic-KV writer is its engine) is sent
one STORE twice the size of its L1: the chunks that fit reach L2 whole, and the rest are counted
in ``kvpersist_l1_stores_dropped_total`` (and its bytes), exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpersist.config.server import load_settings
from kvpersist.serving import http
from kvpersist.serving.launcher.vllm_client import metric_sum
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import server_env, wait_for_l2_idle
from kvpersist.testing.kv_writer import CHUNK_TOKENS, EngineLayout, KvWriter, seeded_fill

#: 2 layers x 2 KV heads x 32, float32: 256 KiB a chunk; an L1 of 8 MiB holds 32.
LAYOUT = EngineLayout("org/model/kvp-" + "b" * 32, 2, 2, 32, 128, torch.float32)
CHUNKS = 64


def test_a_store_beyond_l1_reaches_l2_as_far_as_it_fits_and_the_rest_is_counted(
        tmp_path: Path) -> None:
    settings = load_settings(server_env(tmp_path / "cache", KVP_L1_SIZE_GB="0.0078125"))
    start_server(settings)
    try:
        with KvWriter(settings.request_url, LAYOUT, chunks_per_store=CHUNKS) as writer:
            assert writer.write(list(range(CHUNKS * CHUNK_TOKENS)), seeded_fill(3)) == CHUNKS
        adapter = wait_for_l2_idle(settings)
        metrics = http.get(settings.http_url + "/metrics", timeout=10).body.decode()
    finally:
        stop_server(settings)
    files = sorted(settings.cache_root.glob("*.kvp"))
    dropped = metric_sum(metrics, "kvpersist_l1_stores_dropped_total")
    assert 0 < len(files) < CHUNKS, "L1 took the whole STORE: the test's premise is gone"
    assert len(files) + dropped == CHUNKS, (len(files), dropped)
    assert metric_sum(metrics, "kvpersist_l1_stores_dropped_bytes_total") == \
        dropped * LAYOUT.chunk_bytes
    assert int(adapter["files"]) == len(files)
    assert all(f.stat().st_size == 4096 + LAYOUT.chunk_bytes for f in files)
