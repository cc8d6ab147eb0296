"""Check for a GPU host (never in CI): the LMCache MP server with kvpersist's L2 adapter serving a
client whose KV lives in GPU memory, through the server's restart.

vLLM's CUDA build is too large to bring to a borrowed GPU machine; LMCache's wheel is not.  So
the engine here is LMCache's own bench client in its GPU mode (``lmcache bench server --mode
gpu``): it registers paged KV tensors allocated on the GPU, STOREs and RETRIEVEs them through
the server (the transfer LMCache picks for a GPU client, ``auto``), and checksums the bytes.  Steps:

1. ``kvp-server``'s entry starts the LMCache server with kvpersist's adapter on a fresh
   ``KVP_CACHE_ROOT``; the client STOREs one request of ``--tokens`` tokens from the GPU, and the
   check waits until every chunk is a published L2 file; the client's checksums are kept.
2. The server is stopped and started again (L1 empty, the L2 index from the start-up scan), the
   page cache dropped where the host allows it; a new client LOOKUPs and RETRIEVEs the request
   into zeroed GPU buffers: every chunk must hit and every checksum match (``restore_ok``), and
   the adapter must have read every chunk from L2 (``load_hits``).
3. One L2 file has a payload byte flipped and the server is restarted again: the same restore
   must not serve the whole request (a shorter hit, or a retrieve reported failed when the file
   was in a streamed window), a retrieve reported successful must match, and the file is
   quarantined (moved out of the tree): the check on every read holds on the GPU path too.

Every restore first zeroes the client's KV (LMCache's bench client regenerates its seeded data
on start, and its own zeroing is a no-op when the server moves the bytes), so matching checksums
mean the bytes came back through the server.

It prints one JSON object (sizes, times, GB/s, the adapter's counters) and exits 1 when a check
fails.  ``--mode cpu`` runs the same steps on CPU (a smoke run of this script anywhere).

    python3 benchmarks/gpu/l2_gpu_check.py --tokens 65536 --l1-gb 4     # 2 GiB of KV, < 2 min
    .venv/bin/python benchmarks/gpu/l2_gpu_check.py --mode cpu --tokens 4096 --l1-gb 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.admin.page_cache import drop_page_cache
from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.corruption import corrupt_file
from kvpersist.testing.helpers import adapter_status, l2_data_files, server_env, wait_until
from kvpersist.testing.lmcache_bench import BenchDriver

MODEL = "gpu-check/l2/kvp-" + "7" * 32
HEADS, HEAD_SIZE, BLOCK = 8, 128, 16  # LMCache's bench shape: (2, blocks, 16, heads, 128)


def shape_spec(tokens: int, layers: int) -> tuple[str, int]:
    """LMCache's bench KV shape for ``tokens`` (float16, ``layers`` layers) and its blocks."""
    blocks = tokens // BLOCK + BLOCK
    return f"(2,{blocks},{BLOCK},{HEADS},{HEAD_SIZE}):float16:{layers}", blocks


def cold_page_cache() -> bool:
    """Drop the page cache where this host lets us (a cold L2 read); False otherwise."""
    try:
        drop_page_cache()
    except OSError:
        return False
    return True


def restart(settings: ServerSettings) -> None:
    stop_server(settings)
    start_server(settings)


def driver(settings: ServerSettings, args: argparse.Namespace) -> BenchDriver:
    spec, blocks = shape_spec(args.tokens, args.layers)
    return BenchDriver(settings.request_url, settings.http_url, MODEL, num_tokens=args.tokens,
                       shape_spec=spec, num_blocks=blocks, transfer_mode="auto", mode=args.mode)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    chunks = args.tokens // 256
    kv_bytes = chunks * 256 * 2 * HEADS * HEAD_SIZE * 2 * args.layers
    # lmcache_driven checksums go through the server's HTTP API: loopback TCP for that
    settings = load_settings(server_env(root, KVP_L1_SIZE_GB=str(args.l1_gb),
                                        KVP_CACHE_BUDGET_GB=str(kv_bytes * 3 // 2**30 + 2),
                                        KVP_ACCESS="tcp"))
    out: dict[str, Any] = {"mode": args.mode, "tokens": chunks * 256, "chunks": chunks,
                           "kv_gib": round(kv_bytes / 2**30, 3), "l1_gb": args.l1_gb,
                           "host": platform.node()}
    start_server(settings)
    try:
        d = driver(settings, args)
        began = time.perf_counter()
        stored = d.store(0)
        wait_until(lambda: len(l2_data_files(root)) >= chunks, timeout=600)
        out["store_s"] = round(time.perf_counter() - began, 3)
        out["stored"] = stored
        sums = d.checksums(0)
        d.close()

        restart(settings)
        out["page_cache_dropped"] = cold_page_cache()
        d = driver(settings, args)
        trip = d.timed_restore(0, sums)
        d.close()
        status = adapter_status(settings)
        out.update(restore_ok=trip.ok, hit_chunks=trip.hit_chunks,
                   lookup_s=round(trip.lookup_s, 3), restore_s=round(trip.restore_s, 3),
                   restore_gb_s=round(kv_bytes / 1e9 / trip.restore_s, 2),
                   load_hits=status.get("load_hits"), loaded_bytes=status.get("loaded_bytes"),
                   verify_s=status.get("verify_seconds"))

        victim = l2_data_files(root)[chunks // 2]
        corrupt_file(victim, "flip")  # one payload bit, the header left alone
        restart(settings)
        d = driver(settings, args)
        trip = d.lookup_and_retrieve(0, sums)
        d.close()
        status = adapter_status(settings)
        out.update(corrupt_file=victim.name, corrupt_hit_chunks=trip.hit_chunks,
                   corrupt_retrieve_ok=trip.retrieved_ok,
                   corrupt_checksums_match=trip.checksums_match,
                   corrupt_file_left=victim.exists(), quarantined=status.get("quarantined"))
    finally:
        stop_server(settings)
    out["ok"] = bool(out.get("stored") and out.get("restore_ok") and out["hit_chunks"] == chunks
                     and out.get("load_hits") == chunks
                     # never a whole request served with the bad chunk: a shorter hit, or the
                     # retrieve reported failed (a streamed window that did not verify) ...
                     and (out["corrupt_hit_chunks"] < chunks or not out["corrupt_retrieve_ok"])
                     # ... and what a successful retrieve handed over is the stored bytes
                     and (out["corrupt_checksums_match"] or not out["corrupt_retrieve_ok"])
                     and not out["corrupt_file_left"] and out.get("quarantined") == 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--tokens", type=int, default=65536,
                        help="tokens of the request (whole 256-token chunks are stored)")
    parser.add_argument("--layers", type=int, default=16,
                        help="KV layers (8 heads x 128, float16: 8 KiB per token per layer)")
    parser.add_argument("--l1-gb", type=float, default=4.0)
    parser.add_argument("--root", type=Path, help="KVP_CACHE_ROOT (default: a temp dir)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="kvp-gpu-check-"))
    result = run(args, root)
    print(json.dumps(result, indent=2), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
