"""Benchmark (on demand, never in CI): the kvpersist L2 start-up scan over a large tree.

Generates a tree of N sparse ``.kvp`` files (names and sizes as the adapter writes them; no data
blocks; an existing tree under ``--root`` is reused), then in one run times
``find ROOT -type f | wc -l`` and the store's scan until its index is complete, once with the C
walker and key parser and once with their pure-Python fallbacks, and measures lookups answered
*while* each scan runs (from the disk, with the deterministic file name).

    .venv/bin/python benchmarks/bench_l2_scan.py [--files 1000000] [--root DIR] [--sharded] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvpersist.l2 import inventory
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.store import KvFileStore

CHUNK = 256 * 1024


def key(i: int) -> KeyFields:
    return KeyFields(f"bench/model/kvp-{i % 7:032x}", 0x01000100, 0,
                     (i * 2654435761 % 2**64).to_bytes(8, "big") * 4)


def generate(root: Path, n: int, sharded: bool) -> None:
    store = KvFileStore(root, 1, sharded=sharded)  # only for path_for; never opened
    made: set[Path] = set()
    began = time.monotonic()
    for i in range(n):
        path = store.path_for(key(i))
        if sharded and path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, HEADER_SIZE + CHUNK)
        os.close(fd)
        if i and i % 200_000 == 0:
            print(f"  generated {i} files ({time.monotonic() - began:.0f}s)", flush=True)


def timed_scan(root: Path, files: int, sharded: bool) -> tuple[float, list[float], int, int]:
    """(seconds until the index is complete, lookup latencies meanwhile, hits, files indexed)."""
    store = KvFileStore(root, 10**15, sharded=sharded)
    lookup_lat: list[float] = []
    hits = 0
    began = time.monotonic()
    store.open(background_scan=True)
    probe = 0
    while not store.scan_done:
        t0 = time.perf_counter()
        hits += store.contains(key((probe * 7919) % files))
        lookup_lat.append(time.perf_counter() - t0)
        probe += 1
        time.sleep(0.001)
    store.wait_scan()
    scan_s = time.monotonic() - began
    indexed = len(store)
    assert indexed == files, (indexed, files)
    assert store.used_bytes == files * (HEADER_SIZE + CHUNK)
    store.close()
    return scan_s, lookup_lat, hits, indexed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--root", help="where to build the tree (default: a temp dir)")
    parser.add_argument("--sharded", action="store_true", help="two-level ab/cd/ layout")
    parser.add_argument("--keep", action="store_true", help="keep the generated tree")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvp-scan-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if any(root.iterdir()):
            print(f"reusing the tree in {root}")
        else:
            print(f"generating {args.files} sparse files in {root} (sharded={args.sharded})")
            generate(root, args.files, args.sharded)
        began = time.monotonic()
        found = subprocess.run(f"find {root} -type f | wc -l", shell=True, check=True,
                               capture_output=True, text=True).stdout.strip()
        find_s = time.monotonic() - began
        print(f"find -type f | wc -l : {found} files in {find_s:.2f}s")
        c_walker = inventory._walk
        for label, walker in (("C walker", c_walker), ("Python walker", None)):
            inventory._walk = walker
            scan_s, lookup_lat, hits, indexed = timed_scan(root, args.files, args.sharded)
            print(f"scan, {label:13s}: {indexed} files indexed in {scan_s:.2f}s "
                  f"({scan_s / find_s:.2f}x find)")
            if lookup_lat:
                print(f"  lookups during the scan: {len(lookup_lat)} answered, {hits} hits, p50 "
                      f"{1e6 * statistics.median(lookup_lat):.0f} us, max "
                      f"{1e6 * max(lookup_lat):.0f} us")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
