"""Benchmark (on demand, never in CI): one long chat through real vLLM (CPU) and LMCache,
stored, then restored after restarting both processes with the page cache dropped: how big a
restore works, and how long each side takes.  The CI-sized version is
tests/e2e/test_long_conversation_e2e.py (34k tokens, 34 MiB of KV).

    .venv/bin/python benchmarks/bench_long_chat.py --geometry wide --tokens 32768
        # 16 layers x 8 KV heads x 64, float32: 64 KiB/token, 2 GiB of KV for the prompt
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.demo.tiny_model import LONG_CONTEXT, WIDE_KV, Geometry, build_tiny_model
from kvpersist.serving.server import start_server, stop_server
from kvpersist.testing.helpers import adapter_status, pins_for_model, server_env, wait_for_l2_files
from kvpersist.testing.slow_disk import drop_caches

GEOMETRIES = {"tiny": LONG_CONTEXT, "wide": WIDE_KV._replace(max_pos=40960)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="wide")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--work", help="work directory (default: a temp dir)")
    parser.add_argument("--l1-gb", type=int, help="server L1 and vLLM KV cache space (GiB); "
                        "default: the prompt's KV + 1")
    args = parser.parse_args()
    geometry: Geometry = GEOMETRIES[args.geometry]
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-long-chat-"))
    kv_gib = args.tokens * geometry.kv_bytes_per_token / 2**30
    # Each side holds the prompt's KV once; on CPU, LMCache's engine_driven transport needs
    # about 4.5x the restored bytes in the vLLM worker on top (pickled copies): a 2 GiB restore
    # took 9.6 GB there, so on a 24 GiB machine these two stay small.
    l1_gb = args.l1_gb or int(kv_gib) + 1
    model = build_tiny_model(work / "models", geometry)
    max_len = args.tokens + 2048
    pins = pins_for_model(model, work / "pins.env", max_model_len=max_len)
    env = server_env(work / "cache", KVP_L1_SIZE_GB=str(l1_gb),
                     KVP_CACHE_BUDGET_GB=str(int(kv_gib * 2) + 2))
    settings = load_settings(env)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(l1_gb)
    messages = long_conversation(args.tokens, "a very long chat")
    result: dict[str, object] = {"geometry": args.geometry, "kv_bytes_per_token":
                                 geometry.kv_bytes_per_token}
    vllm = VllmProcess(model, pins, work / "vllm-1.log", env, max_model_len=max_len)
    try:
        start_server(settings)
        vllm.start(timeout=1800)
        cold = chat(vllm.base_url, messages, timeout=7200)
        chunks = cold.prompt_tokens // 256
        result.update(prompt_tokens=cold.prompt_tokens, kv_gib=round(
            chunks * 256 * geometry.kv_bytes_per_token / 2**30, 3), cold_s=round(cold.seconds, 2))
        wait_for_l2_files(settings.cache_root, chunks, timeout=1800)
        vllm.stop()
        stop_server(settings)
        start_server(settings)
        vllm = VllmProcess(model, pins, work / "vllm-2.log", env, max_model_len=max_len)
        vllm.start(timeout=1800)
        drop_caches()
        warm = chat(vllm.base_url, messages, timeout=7200)
        status = adapter_status(settings)
        result.update(
            restored_s=round(warm.seconds, 2),
            hit_tokens=metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total"),
            full_chunk_tokens=256 * chunks, cached_tokens=warm.cached_tokens,
            identical=(warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs),
            l2_load_seconds=status["load_seconds"], l2_loaded_bytes=status["loaded_bytes"])
    finally:
        vllm.kill()
        stop_server(settings)
    print(json.dumps(result, indent=2))
    # Restored means vLLM used it: the hits were loaded (cached_tokens), not recomputed after a
    # failed retrieve (which vLLM still counts as external hits).
    restored = result.get("cached_tokens") == 256 * chunks
    return 0 if result.get("identical") and restored else 1


if __name__ == "__main__":
    raise SystemExit(main())
