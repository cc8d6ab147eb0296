"""Benchmark (on demand, never in CI): a kvpersist tree shared by nodes on a real GlusterFS volume
(started here on 127.0.0.2, two FUSE mounts, torn down at the end), against the same work on the
local disk in the same run.  Needs root and GlusterFS (scripts/install-glusterfs.sh).

1. Cross-node restore: LMCache's bench client stores one request through node A (mount 0); the
   servers restart and the page cache is dropped; the request is restored through node A itself
   (local part) and through node B (mount 1, A's part read over the shared tree), each after a
   cold ``cat`` of the same files through the same mount.
2. The cost of a lookup miss: one ``stat`` per other node; timed per missed key with N node
   parts (N = 2 .. --max-nodes), through a GlusterFS mount and on the local disk, and with P
   processes looking up at once (the aggregate rate a tree of P nodes would see).

    .venv/bin/python benchmarks/bench_shared_tree.py [--tokens 16384] [--max-nodes 64]
        [--processes 1,4,8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.l2.layout import KeyFields, format_name
from kvpersist.l2.shared_tree import SharedTree
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import glusterfs
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.slow_disk import drop_caches

MODEL = "bench/shared/kvp-" + "8" * 32


def shape(tokens: int) -> tuple[str, int]:
    """32 KiB of KV per token (8 layers x 8 KV heads x 128 x fp16 x K,V): 8 MiB per chunk."""
    blocks = tokens // 16 + 16
    return f"(2,{blocks},16,8,128):float16:8", blocks


def node_settings(tree: Path, node: str, run: Path) -> ServerSettings:
    return load_settings(environ={
        "KVP_CACHE_ROOT": str(tree), "KVP_NODE_ID": node, "KVP_SHARED_NODES": "2",
        "KVP_RUNTIME_DIR": str(run / node), "KVP_L1_SIZE_GB": "4", "KVP_CACHE_BUDGET_GB": "100"})


def driver(s: ServerSettings, tokens: int) -> BenchDriver:
    spec, blocks = shape(tokens)
    return BenchDriver(s.request_url, s.http_url, MODEL, num_tokens=tokens, shape_spec=spec,
                       num_blocks=blocks)


def restore(s: ServerSettings, tokens: int, sums: list[str]) -> tuple[float, float, bool]:
    """(L2->L1 seconds (the lookup, which loads the prefix), whole restore seconds, ok)."""
    d = driver(s, tokens)
    trip = d.timed_restore(0, sums)
    d.close()
    return trip.lookup_s, trip.restore_s, trip.ok


def cold_cat(files: list[Path]) -> float:
    drop_caches()
    began = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def cross_node(mounts: list[Path], run: Path, tokens: int, rounds: int) -> dict[str, Any]:
    a, b = (node_settings(m / "restore", n, run) for m, n in zip(mounts, "ab", strict=True))
    start_server(a)
    try:
        d = driver(a, tokens)
        sums = d.checksums(0)
        assert d.store(0), "store refused"
        part = a.cache_root
        while len(list(part.glob("*.kvp"))) < len(sums):
            time.sleep(0.05)
        time.sleep(1.0)
        d.close()
    finally:
        stop_server(a)
    files_a = sorted(a.cache_root.glob("*.kvp"))
    files_b = [b.tree / "nodes" / "a" / f.name for f in files_a]  # the same files, mount 1
    nbytes = sum(f.stat().st_size for f in files_a)
    out: dict[str, Any] = {"tokens": tokens, "chunks": len(sums), "bytes": nbytes}
    setups = [("local (node a, own part)", a, files_a),
              ("other node (b reads a's part)", b, files_b)]
    for n in range(rounds):  # alternating order, so neither always goes first
        for name, s, files in setups if n % 2 == 0 else setups[::-1]:
            start_server(s)
            try:
                cat_s = cold_cat(files)
                drop_caches()
                l2_s, seconds, ok = restore(s, tokens, sums)
            finally:
                stop_server(s)
            out.setdefault(name, []).append({"l2_to_l1_s": l2_s, "restore_s": seconds, "ok": ok,
                                             "cold_cat_s": cat_s, "x_cat": cat_s / l2_s})
    return out


def _key(i: int) -> KeyFields:
    return KeyFields(MODEL, 0, 0, i.to_bytes(32, "big"), "")


def _miss_worker(args: tuple[str, int]) -> int:
    tree, keys = args
    probe = SharedTree(Path(tree), Path(tree) / "nodes" / "n0", lambda k: (format_name(k),),
                       negative_ttl_s=0.0)
    probe.other_parts()
    base = os.getpid() << 32
    for i in range(keys):
        assert probe.find(_key(base + i)) is None
    return int(probe.status()["fs_ops"])


def miss_cost(tree: Path, nodes: int, processes: int, keys: int) -> dict[str, Any]:
    for n in range(nodes):
        (tree / "nodes" / f"n{n}").mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        ops = sum(pool.map(_miss_worker, [(str(tree), keys)] * processes))
    seconds = time.perf_counter() - began
    lookups = processes * keys
    return {"nodes": nodes, "processes": processes, "lookups": lookups, "fs_ops": ops,
            "ops_per_miss": ops / lookups, "us_per_miss": 1e6 * seconds * processes / lookups,
            "misses_per_s": lookups / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--processes", default="1,4,8")
    parser.add_argument("--keys", type=int, default=200, help="missed keys per process")
    parser.add_argument("--rounds", type=int, default=3, help="cross-node restore rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    reason = glusterfs.unavailable()
    if reason:
        raise SystemExit(f"bench_shared_tree: {reason}")
    results: dict[str, Any] = {"miss": []}
    work = Path(tempfile.mkdtemp(prefix="kvp-shared-"))
    with glusterfs.gluster_volume(work / "gluster", mounts=2) as volume:
        results["cross_node"] = cross_node(volume.mounts, work / "run", args.tokens,
                                           args.rounds)
        node_counts = [n for n in (2, 4, 16, 64, 256) if n <= args.max_nodes]
        for where, tree in (("glusterfs", volume.mounts[0] / "miss"), ("local", work / "miss")):
            for nodes in node_counts:
                for procs in (int(p) for p in args.processes.split(",")):
                    row = {"fs": where, **miss_cost(tree, nodes, procs, args.keys)}
                    results["miss"].append(row)
                    print(json.dumps(row), flush=True)
    cross = results["cross_node"]
    print(f"\ncross-node restore of {cross['tokens']} tokens ({cross['bytes'] / 2**20:.0f} MiB "
          f"in {cross['chunks']} files), page cache dropped, GlusterFS 2 bricks on this disk:")
    med: dict[str, dict[str, float]] = {}
    for name in ("local (node a, own part)", "other node (b reads a's part)"):
        rows = cross[name]
        med[name] = {k: statistics.median(r[k] for r in rows)
                     for k in ("l2_to_l1_s", "restore_s", "cold_cat_s", "x_cat")}
        m = med[name]
        print(f"  {name:<32} L2->L1 {m['l2_to_l1_s']:.2f}s (x cold cat {m['x_cat']:.2f}), whole "
              f"restore {m['restore_s']:.2f}s, cold cat {m['cold_cat_s']:.2f}s, "
              f"ok={all(r['ok'] for r in rows)}")
    local, other = (med[n]["l2_to_l1_s"] for n in med)
    print(f"  other node / local, L2->L1 (median of {len(cross[next(iter(med))])}): "
          f"{other / local:.2f}x")
    print("\nlookup miss on the shared tree (one stat per other node; negative cache off):")
    print(f"  {'fs':<10} {'nodes':>5} {'procs':>5} {'ops/miss':>8} {'us/miss':>9} {'misses/s':>9}")
    for r in results["miss"]:
        print(f"  {r['fs']:<10} {r['nodes']:>5} {r['processes']:>5} {r['ops_per_miss']:>8.1f} "
              f"{r['us_per_miss']:>9.0f} {r['misses_per_s']:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
