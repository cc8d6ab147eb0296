"""Benchmark (on demand, never in CI): one long chat through real vLLM (CPU) and LMCache,
stored, then restored after restarting both processes with the page cache dropped: how big a
restore works, and how long each side takes.  The CI-sized version is
tests/e2e/test_long_conversation_e2e.py (34k tokens, 34 MiB of KV).

    .venv/bin/python benchmarks/bench_long_chat.py --geometry wide --tokens 32768
        # 16 layers x 8 KV heads x 64, float32: 64 KiB/token, 2 GiB of KV for the prompt
    .venv/bin/python benchmarks/bench_long_chat.py --geometry wide --tokens 8192 \
        --transfer-modes engine_driven,lmcache_driven
        # LMCache's two CPU transports side by side in one run (restored TTFT, /dev/shm left)
    .venv/bin/python benchmarks/bench_long_chat.py --geometry mid --tokens 127500 --l1-gb 0.5
        # 131k tokens at 16 KiB/token (2 GiB of KV) through an L1 of 0.5 GiB: the restore
        # streams through L1 (kvpersist.serving.lmcache_compat.l1_window); also a cold raw read of the
        # same files, with the page cache dropped, and the same chat sent again with its prefix
        # in vLLM (the suffix's compute and the answer), so the restore alone is compared
    .venv/bin/python benchmarks/bench_long_chat.py --geometry mid --tokens 127500 --l1-gb 0.5 \
        --l2-direct-io true --also-restore-with KVP_L2_DIRECT_IO=false \
        --also-restore-with KVP_L2_DIRECT_IO=true
        # the same, restored with O_DIRECT, buffered and O_DIRECT again on one stored chat
    .venv/bin/python benchmarks/bench_long_chat.py --geometry mid --tokens 127500 --l1-gb 0.5 \
        --also-restore-with KVP_CPU_DIRECT_COPY=false --also-restore-with KVP_CPU_DIRECT_COPY=true
        # the one-pass CPU copy against LMCache's staged copy, then again, on one stored chat

The restore is judged bit-identical (tokens and logprobs) and complete (every full chunk from
L2, ``cached_tokens``).  vLLM's own KV space is sized for the prompt, separately from L1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import ChatResult, VllmProcess, chat, long_conversation, metric_sum
from kvpersist.demo.tiny_model import LONG_CONTEXT, WIDE_KV, Geometry, build_tiny_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import (
    adapter_status,
    l2_data_files,
    pins_for_model,
    server_env,
    server_settings_in,
    setting_overrides,
    wait_for_l2_files,
)
from kvpersist.testing.slow_disk import drop_caches

#: Samples of the suffix's own compute and of the cold raw read; their medians are the figures.
SAMPLES = 3
GEOMETRIES = {"tiny": LONG_CONTEXT, "wide": WIDE_KV._replace(max_pos=40960),
              # 8 layers x 4 KV heads x 64, float32: 16 KiB/token, 2 GiB at 128k tokens
              "mid": Geometry("kvpersist/tiny-llama-mid-kv", 256, 8, 4, 4, 64, 147456)}


def raw_cold_read(files: list[Path]) -> tuple[float, int]:
    """Seconds and bytes to read ``files`` whole, one after another, after dropping the page
    cache: what the device gives without kvpersist, LMCache or vLLM."""
    drop_caches()
    began, total = time.monotonic(), 0
    for path in files:
        with path.open("rb", buffering=0) as f:
            while block := f.read(8 << 20):
                total += len(block)
    return time.monotonic() - began, total


def shm_segments() -> dict[str, int]:
    """LMCache's shared-memory segments in /dev/shm: name -> bytes (apparent size)."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith("lmcache"):
                with contextlib.suppress(OSError):
                    found[entry.name] = entry.stat().st_size
    return found


@dataclass(frozen=True)
class ChatSetup:
    """What restoring the long chat of a work directory takes: the same for the run that stored
    it and for any later one that restores it again (restore_cpu_accounting.py)."""

    model: Path
    pins: Path
    max_len: int
    server_vars: dict[str, str]  # the server's settings alone (load_settings refuses others)
    vllm_env: dict[str, str]  # server_vars and vLLM's own KV space
    messages: list[dict[str, str]]


def chat_setup(work: Path, geometry: Geometry, tokens: int, l1_gb: float,
               **server: str) -> ChatSetup:
    """The model, pins and settings of a ``tokens``-token chat in ``work`` (the model is built
    the first time); ``server``: further server settings."""
    kv_gib = tokens * geometry.kv_bytes_per_token / 2**30
    model = build_tiny_model(work / "models", geometry)
    max_len = int(tokens * 1.1) + 2048  # long_conversation overshoots its target a little
    pins = pins_for_model(model, work / "pins.env", max_model_len=max_len)
    server_vars = server_env(work / "cache", KVP_L1_SIZE_GB=f"{l1_gb:g}",
                             KVP_CACHE_BUDGET_GB=str(int(kv_gib * 2) + 2), **server)
    vllm_env = {**server_vars, "VLLM_CPU_KVCACHE_SPACE":
                str(int(max_len * geometry.kv_bytes_per_token / 2**30) + 1)}
    return ChatSetup(model, pins, max_len, server_vars, vllm_env,
                     long_conversation(tokens, "a very long chat"))


def run_once(args: argparse.Namespace, geometry: Geometry, work: Path,
             mode: str | None) -> dict[str, object]:
    """Store one long chat, restart both processes, drop the page cache, restore it."""
    kv_gib = args.tokens * geometry.kv_bytes_per_token / 2**30
    # Each side holds the prompt's KV once; on CPU, LMCache's engine_driven transport needs
    # about 4.5x the restored bytes in the vLLM worker on top (pickled copies): a 2 GiB restore
    # took 9.6 GB there, so on a 24 GiB machine these two stay small.
    l1_gb = args.l1_gb or int(kv_gib) + 1
    setup = chat_setup(work, geometry, args.tokens, l1_gb,
                       **({} if args.l2_direct_io is None
                          else {"KVP_L2_DIRECT_IO": args.l2_direct_io}))
    model, pins, max_len, messages = setup.model, setup.pins, setup.max_len, setup.messages
    server_vars, env = setup.server_vars, dict(setup.vllm_env)
    settings = load_settings(server_vars)
    if mode is not None:
        env["KVP_MP_TRANSFER_MODE"] = mode
    result: dict[str, object] = {"geometry": args.geometry, "transfer_mode": mode or "default",
                                 "l2_direct_io": settings.l2_direct_io,
                                 "kv_bytes_per_token": geometry.kv_bytes_per_token}
    shm_before = shm_segments()
    vllm = VllmProcess(model, pins, work / "vllm-1.log", env, max_model_len=max_len,
                       compile=True)
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

        def restore(vllm_env: dict[str, str], log: str) -> tuple[VllmProcess, ChatResult,
                                                                  dict[str, Any]]:
            """Start the (stopped) server under the current ``settings`` and a new vLLM, drop
            the page cache, restore the chat: (the vLLM, its answer, the adapter's status)."""
            start_server(settings)
            started = VllmProcess(model, pins, work / log, vllm_env, max_model_len=max_len,
                                  compile=True)
            started.start(timeout=1800)
            drop_caches()
            answer = chat(started.base_url, messages, timeout=7200)
            return started, answer, adapter_status(settings)

        def record(answer: ChatResult, status: dict[str, Any]) -> dict[str, object]:
            return {"l2_direct_io": settings.l2_direct_io, "restored_s": round(answer.seconds, 2),
                    "identical": (answer.tokens, answer.logprobs) == (cold.tokens, cold.logprobs),
                    "cached_tokens": answer.cached_tokens,
                    "l2_load_seconds": status["load_seconds"]}

        vllm, warm, status = restore(env, "vllm-2.log")
        # The same chat again on the same vLLM, its prefix now in vLLM's own cache: what the
        # suffix after the last full chunk and the answer cost without any restore (the median
        # of SAMPLES: one sample swings by a few tenths of a second on a busy 2-core machine).
        suffixes = [chat(vllm.base_url, messages, timeout=7200).seconds for _ in range(SAMPLES)]
        suffix_s = statistics.median(suffixes)
        files = l2_data_files(settings.cache_root)
        raws = [raw_cold_read(files) for _ in range(SAMPLES)]
        raw_s, raw_bytes = statistics.median(s for s, _ in raws), raws[0][1]
        result.update(
            suffix_and_answer_samples_s=[round(s, 2) for s in suffixes],
            raw_cold_read_samples_s=[round(s, 2) for s, _ in raws],
            l1_gb=l1_gb, l1_to_kv=round(l1_gb / kv_gib, 3) if kv_gib else None,
            raw_cold_read_s=round(raw_s, 2), raw_cold_read_gib=round(raw_bytes / 2**30, 3),
            restored_over_raw_read=round(warm.seconds / raw_s, 2) if raw_s else None,
            suffix_and_answer_s=round(suffix_s, 2),
            restore_alone_over_raw_read=round((warm.seconds - suffix_s) / raw_s, 2)
            if raw_s else None,
            cold_over_restored=round(cold.seconds / warm.seconds, 2) if warm.seconds else None,
            restored_s=round(warm.seconds, 2),
            hit_tokens=metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total"),
            full_chunk_tokens=256 * chunks, cached_tokens=warm.cached_tokens,
            identical=(warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs),
            l2_load_seconds=status["load_seconds"], l2_loaded_bytes=status["loaded_bytes"])
        vllm.stop()  # a graceful stop, as an operator's would be
        restores = [record(warm, status)]
        restores[0]["variant"] = "as configured"
        for n, variant in enumerate(args.also_restore_with):
            # The same stored chat, restored again with the server restarted under other
            # settings (both processes restarted, the page cache dropped), side by side.
            spec = ",".join(f"{k}={v}" for k, v in variant.items())
            stop_server(settings)
            settings = load_settings({**server_vars, **server_settings_in(variant)})
            vllm, again, status = restore({**env, **variant}, f"vllm-variant-{n}.log")
            restores.append({**record(again, status), "variant": spec})
            vllm.stop()
        for r in restores:
            restored = float(r["restored_s"])  # type: ignore[arg-type]
            r["restore_alone_over_raw_read"] = (round((restored - suffix_s) / raw_s, 2)
                                                if raw_s else None)
        result["restores"] = restores
        if len(restores) > 1:
            print(f"\n{'variant':<28} {'restored s':>11} {'alone/raw':>10} {'L2 load s':>10} "
                  f"{'cached':>8} {'identical':>9}")
            for r in restores:
                print(f"{r['variant']!s:<28} {r['restored_s']:>11} "
                      f"{r['restore_alone_over_raw_read']!s:>10} "
                      f"{r['l2_load_seconds']:>10.2f} {r['cached_tokens']!s:>8} "
                      f"{r['identical']!s:>9}")
    finally:
        vllm.kill()
        stop_server(settings)
    left = {name: size for name, size in shm_segments().items() if name not in shm_before}
    result.update(shm_segments_left=len(left), shm_bytes_left=sum(left.values()))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="wide")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--work", help="work directory (default: a temp dir)")
    parser.add_argument("--l1-gb", type=float, help="the server's L1 (GiB); below the "
                        "prompt's KV the restore streams through it; default: the prompt's KV + 1")
    parser.add_argument("--l2-direct-io", choices=("true", "false"),
                        help="KVP_L2_DIRECT_IO for the server (default: the product's default)")
    parser.add_argument("--also-restore-with", action="append", default=[],
                        type=setting_overrides, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="after the restore, restore the same chat again with the server "
                        "restarted under these settings (repeatable): variants side by side "
                        "on one stored chat, without another cold prefill")
    parser.add_argument("--transfer-modes", default="",
                        help="comma-separated LMCache transfer modes to run one after another "
                        "(engine_driven, lmcache_driven); default: the launcher's choice")
    args = parser.parse_args()
    geometry: Geometry = GEOMETRIES[args.geometry]
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-long-chat-"))
    modes: list[str | None] = [m for m in args.transfer_modes.split(",") if m] or [None]
    results = [run_once(args, geometry, work / (m or "default"), m) for m in modes]
    print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    if len(results) > 1:
        base = float(results[0].get("restored_s", 0) or 0)
        print(f"\n{'mode':<16} {'cold s':>8} {'restored s':>11} {'x first':>8} "
              f"{'cached':>8} {'identical':>9} {'/dev/shm left':>14}")
        for r in results:
            restored = float(r.get("restored_s", 0) or 0)
            print(f"{r['transfer_mode']!s:<16} {r.get('cold_s', '-')!s:>8} {restored:>11.2f} "
                  f"{(base / restored if restored else 0):>8.2f} {r.get('cached_tokens')!s:>8} "
                  f"{r.get('identical')!s:>9} {r['shm_bytes_left']:>14,}")
    # Restored means vLLM used it: the hits were loaded (cached_tokens), not recomputed after a
    # failed retrieve (which vLLM still counts as external hits).
    ok = all(r.get("identical") and r.get("cached_tokens") == r.get("full_chunk_tokens")
             and all(x["identical"] and x["cached_tokens"] == r.get("full_chunk_tokens")
                     for x in r.get("restores", []))  # type: ignore[attr-defined]
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
