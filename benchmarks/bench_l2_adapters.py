"""Benchmark (run on demand, never in CI): kvpersist's L2 adapter vs LMCache's nixl_store_dynamic
(POSIX), side by side in one run on the same disk, through the real LMCache MP server.

Both servers run at once on the same disk and every measurement alternates between them.  For
each chunk size, LMCache's own bench client stores one-chunk requests (the time until the chunk's
L2 file is published is the per-chunk store latency) and then, with L1 cleared, looks up and
retrieves them (the LOOKUP+RETRIEVE time is the per-chunk load latency; it includes the server's
L2 load into L1 and the ZMQ transfer to the client, the same for both adapters).  The
verification share is given against that load time and, in brackets, against the adapter's own
file-read time alone.  It also reports raw sequential disk
throughput measured with ``dd`` on the same file system, and, for kvpersist, the share of load
time spent verifying (from the adapter's own counters).

    .venv/bin/python benchmarks/bench_l2_adapters.py [--root DIR] [--chunks 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import free_port
from kvpersist.serving.lmcache_compat import status as server_status
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import clear_l1
from kvpersist.testing.lmcache_bench import BenchDriver

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


def adapter_status(s: ServerSettings) -> dict[str, Any]:
    """The first L2 adapter's status (kvpersist's or nixl_store_dynamic's)."""
    return dict(server_status.l2_adapters(server_status.fetch(s.http_url, timeout=30) or {})[0])


def wait_count(root: Path, suffix: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for _ in root.glob("*" + suffix)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {count} {suffix} files in {root}")
        time.sleep(0.0005)


ADAPTERS = ("kvpersist", "nixl_store_dynamic")


def timed_load(d: BenchDriver, seq: int, expected: list[str]) -> float:
    """Seconds for LOOKUP + RETRIEVE of one request (zeroing and checksums are outside)."""
    request = d._request(seq, "load")
    d.client.zero_destination(request, 0, request.num_full_tokens)
    began = time.perf_counter()
    lookup = d.client.lookup(request)
    result = d.client.retrieve(request, 0, lookup.hit_chunks * request.chunk_size)
    spent = time.perf_counter() - began
    got = d.client.compute_checksums(request, 0, request.num_full_tokens)
    d.client.end_session(request)
    if lookup.hit_chunks != request.total_chunks or result is None or not result.succeeded \
            or list(got or []) != expected:
        raise RuntimeError(f"{d.model_name}: load {seq} failed or returned other bytes")
    return spent


def run_interleaved(base: Path, chunks: int) -> dict[str, dict[str, Any]]:
    """Both servers run at once; every measurement alternates between them, so drift of the
    machine (other load, page cache, CPU frequency) hits both alike."""
    settings = {a: load_settings({
        "KVP_CACHE_ROOT": str(base / a), "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": "2",
        "KVP_CACHE_BUDGET_GB": "64", "KVP_L2_ADAPTER": a}) for a in ADAPTERS}
    out: dict[str, dict[str, Any]] = {a: {} for a in ADAPTERS}
    for s in settings.values():
        start_server(s)
    try:
        for size, spec in SHAPES.items():
            n = max(8, chunks * 256 * 1024 // size) if size > 256 * 1024 else chunks
            drivers = {a: BenchDriver(s.request_url, s.http_url,
                                      f"bench/{a}/kvp-{size:032x}", num_tokens=256,
                                      shape_spec=spec.format(nb=16 * n + 16))
                       for a, s in settings.items()}
            store_lat: dict[str, list[float]] = {a: [] for a in ADAPTERS}
            load_lat: dict[str, list[float]] = {a: [] for a in ADAPTERS}
            for seq in range(n):
                for a in (ADAPTERS if seq % 2 == 0 else ADAPTERS[::-1]):
                    root = settings[a].cache_root
                    before = sum(1 for _ in root.glob("*" + SUFFIX[a]))
                    began = time.perf_counter()
                    if not drivers[a].store(seq):
                        raise RuntimeError(f"{a}: store {seq} failed")
                    wait_count(root, SUFFIX[a], before + 1)
                    store_lat[a].append(time.perf_counter() - began)
            sums = {a: [drivers[a].checksums(seq) for seq in range(n)] for a in ADAPTERS}
            for s in settings.values():
                clear_l1(s)
            status0 = adapter_status(settings["kvpersist"])
            for seq in range(n):
                for a in (ADAPTERS if seq % 2 == 0 else ADAPTERS[::-1]):
                    load_lat[a].append(timed_load(drivers[a], seq, sums[a][seq]))
            status = adapter_status(settings["kvpersist"])
            for a in ADAPTERS:
                out[a][str(size)] = {
                    "chunks": n,
                    "store_GBps": n * size / sum(store_lat[a]) / 1e9,
                    "store_p50_ms": 1000 * statistics.median(store_lat[a]),
                    "store_p99_ms": 1000 * pct(store_lat[a], 0.99),
                    "load_GBps": n * size / sum(load_lat[a]) / 1e9,
                    "load_p50_ms": 1000 * statistics.median(load_lat[a]),
                    "load_p99_ms": 1000 * pct(load_lat[a], 0.99),
                }
            load_s = status["load_seconds"] - status0["load_seconds"]
            verify_s = status["verify_seconds"] - status0["verify_seconds"]
            row = out["kvpersist"][str(size)]
            row["adapter_load_ms"] = 1000 * load_s / n
            row["verify_share_of_adapter_load"] = verify_s / load_s if load_s else None
            row["verify_share_of_load"] = verify_s / sum(load_lat["kvpersist"])
            for d in drivers.values():
                d.close()
    finally:
        for s in settings.values():
            stop_server(s)
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
    results.update(run_interleaved(base, args.chunks))
    print(f"raw disk (dd, same fs): write+fdatasync {results['dd']['write_fdatasync_GBps']:.2f} "
          f"GB/s, read (page cache) {results['dd']['read_cached_GBps']:.2f} GB/s")
    header = (f"{'chunk':>7} {'adapter':>19} {'store GB/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'load GB/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'verify % of load':>17}")
    print(header)
    for size in SHAPES:
        for adapter in ("kvpersist", "nixl_store_dynamic"):
            r = results[adapter][str(size)]
            share = ""
            if "verify_share_of_load" in r:
                share = (f"{100 * r['verify_share_of_load']:.2f} "
                         f"(adapter {100 * r['verify_share_of_adapter_load']:.0f})")
            print(f"{size // 1024:>6}K {adapter:>19} {r['store_GBps']:>10.3f} "
                  f"{r['store_p50_ms']:>7.2f} {r['store_p99_ms']:>7.2f} {r['load_GBps']:>9.3f} "
                  f"{r['load_p50_ms']:>7.2f} {r['load_p99_ms']:>7.2f} {share:>17}")
        k, n = results["kvpersist"][str(size)], results["nixl_store_dynamic"][str(size)]
        print(f"{'':>7} {'ratio kvp/nixl':>19} {k['store_GBps'] / n['store_GBps']:>10.2f} "
              f"{'':>15} {k['load_GBps'] / n['load_GBps']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
