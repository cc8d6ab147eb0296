"""Benchmark (run on demand, never in CI): kvpersist's L2 adapter vs LMCache's nixl_store_dynamic
(POSIX), side by side in one run on the same disk, through the real LMCache MP server.

For each chunk size, LMCache's own bench client stores one-chunk requests (the time until the
chunk's L2 file is published is the per-chunk store latency) and then, with L1 cleared, looks up
and retrieves them (the lookup+retrieve time is the per-chunk load latency; it includes the ZMQ
transfer to the client, the same for both adapters).  It also reports raw sequential disk
throughput measured with ``dd`` on the same file system, and, for kvpersist, the share of load
time spent verifying (from the adapter's own counters).

    .venv/bin/python benchmarks/bench_l2_adapters.py [--root DIR] [--chunks 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "implementation"), str(REPO / "tests")]

from kvpersist.server import http_get, start_server, stop_server  # noqa: E402
from kvpersist.settings import ServerSettings, load_settings  # noqa: E402
from kvpersist.stack import free_port  # noqa: E402

from lmcache_client import BenchDriver  # noqa: E402

#: chunk bytes → LMCache KV shape spec (2, blocks, 16 tokens, heads, head size):fp16:layers
SHAPES = {
    256 * 1024: "(2,{nb},16,2,64):float16:2",
    1024 * 1024: "(2,{nb},16,8,64):float16:2",
    2 * 1024 * 1024: "(2,{nb},16,8,128):float16:2",
    8 * 1024 * 1024: "(2,{nb},16,8,128):float16:8",
}
SUFFIX = {"kvpersist": ".kvp", "nixl_store_dynamic": ".bin"}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def clear_l1(s: ServerSettings) -> None:
    req = urllib.request.Request(s.http_url + "/cache/clear", method="POST",
                                 data=b'{"tier":"l1","force":true}',
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).close()


def adapter_status(s: ServerSettings) -> dict[str, Any]:
    _, body = http_get(s.http_url + "/status", timeout=30)
    return dict(json.loads(body)["storage_manager"]["l2_adapters"][0])


def wait_count(root: Path, suffix: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for _ in root.glob("*" + suffix)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {count} {suffix} files in {root}")
        time.sleep(0.0005)


def run_adapter(adapter: str, root: Path, chunks: int) -> dict[str, Any]:
    settings = load_settings({
        "KVP_CACHE_ROOT": str(root), "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": "4",
        "KVP_CACHE_BUDGET_GB": "64", "KVP_L2_ADAPTER": adapter})
    out: dict[str, Any] = {}
    start_server(settings)
    try:
        for size, spec in SHAPES.items():
            n = max(8, chunks * 256 * 1024 // size) if size > 256 * 1024 else chunks
            model = f"bench/{adapter}/kvp-{size:032x}"
            d = BenchDriver(f"{settings.zmq_url}:{settings.zmq_port}", settings.http_url,
                            model, num_tokens=256, shape_spec=spec.format(nb=16 * n + 16))
            store_lat: list[float] = []
            for seq in range(n):
                before = sum(1 for _ in root.glob("*" + SUFFIX[adapter]))
                began = time.perf_counter()
                if not d.store(seq):
                    raise RuntimeError(f"{adapter}: store {seq} failed")
                wait_count(root, SUFFIX[adapter], before + 1)
                store_lat.append(time.perf_counter() - began)
            sums = [d.checksums(seq) for seq in range(n)]
            clear_l1(settings)
            status0 = adapter_status(settings) if adapter == "kvpersist" else {}
            load_lat: list[float] = []
            for seq in range(n):
                began = time.perf_counter()
                trip = d.lookup_and_retrieve(seq, sums[seq])
                load_lat.append(time.perf_counter() - began)
                if trip.hit_chunks != 1 or not trip.checksums_match:
                    raise RuntimeError(f"{adapter}: load {seq} failed: {trip}")
            row = {
                "chunks": n,
                "store_GBps": n * size / sum(store_lat) / 1e9,
                "store_p50_ms": 1000 * statistics.median(store_lat),
                "store_p99_ms": 1000 * pct(store_lat, 0.99),
                "load_GBps": n * size / sum(load_lat) / 1e9,
                "load_p50_ms": 1000 * statistics.median(load_lat),
                "load_p99_ms": 1000 * pct(load_lat, 0.99),
            }
            if adapter == "kvpersist":
                status = adapter_status(settings)
                load_s = status["load_seconds"] - status0["load_seconds"]
                verify_s = status["verify_seconds"] - status0["verify_seconds"]
                row["verify_share_of_adapter_load"] = verify_s / load_s if load_s else None
                row["verify_share_of_client_load"] = verify_s / sum(load_lat)
            d.close()
            out[str(size)] = row
    finally:
        stop_server(settings)
    return out


def dd_throughput(root: Path) -> dict[str, float]:
    target = root / "dd.probe"
    res: dict[str, float] = {}
    for name, cmd in (
        ("write_fdatasync", ["dd", "if=/dev/zero", f"of={target}", "bs=8M", "count=128",
                             "conv=fdatasync"]),
        ("read_cached", ["dd", f"if={target}", "of=/dev/null", "bs=8M"]),
    ):
        began = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        res[name + "_GBps"] = 128 * 8 * 1024 * 1024 / (time.perf_counter() - began) / 1e9
    target.unlink()
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--chunks", type=int, default=48, help="256 KiB chunks per run")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    base = Path(args.root or tempfile.mkdtemp(prefix="kvp-bench-"))
    results: dict[str, Any] = {"dd": dd_throughput(base)}
    for adapter in ("kvpersist", "nixl_store_dynamic"):
        results[adapter] = run_adapter(adapter, base / adapter, args.chunks)
    print(f"raw disk (dd, same fs): write+fdatasync {results['dd']['write_fdatasync_GBps']:.2f} "
          f"GB/s, read (page cache) {results['dd']['read_cached_GBps']:.2f} GB/s")
    header = (f"{'chunk':>7} {'adapter':>19} {'store GB/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'load GB/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'verify%':>7}")
    print(header)
    for size in SHAPES:
        for adapter in ("kvpersist", "nixl_store_dynamic"):
            r = results[adapter][str(size)]
            share = r.get("verify_share_of_adapter_load")
            print(f"{size // 1024:>6}K {adapter:>19} {r['store_GBps']:>10.3f} "
                  f"{r['store_p50_ms']:>7.2f} {r['store_p99_ms']:>7.2f} {r['load_GBps']:>9.3f} "
                  f"{r['load_p50_ms']:>7.2f} {r['load_p99_ms']:>7.2f} "
                  f"{'' if share is None else f'{100 * share:.1f}':>7}")
        k, n = results["kvpersist"][str(size)], results["nixl_store_dynamic"][str(size)]
        print(f"{'':>7} {'ratio kvp/nixl':>19} {k['store_GBps'] / n['store_GBps']:>10.2f} "
              f"{'':>15} {k['load_GBps'] / n['load_GBps']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
