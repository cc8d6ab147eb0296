"""Benchmark (on demand, never in CI): the kvpersist L2 start-up scan over a large tree.

Generates a tree of N sparse ``.kvp`` files (names and sizes as the adapter writes them; no data
blocks; an existing tree under ``--root`` is reused), then in one run times
``find ROOT -type f | wc -l`` and, until the store's index is complete (stores resume then):

- the walk a start after a crash makes (C walker and key parser; with ``--python-walker`` also
  their pure-Python fallbacks), with lookups answered *while* it runs (from the disk);
- a clean stop (the store's close, which walks the tree once more and writes the index
  snapshot);
- the start after that clean stop, which adopts the snapshot.

    .venv/bin/python benchmarks/bench_l2_scan.py [--files 1000000] [--root DIR] [--sharded]
        [--keep] [--python-walker] [--through-adapter] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
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


def timed_scan(root: Path, files: int, sharded: bool, *, snapshot: bool
               ) -> tuple[float, list[float], int, KvFileStore]:
    """(seconds until the index is complete, lookup latencies meanwhile, hits, the open
    store)."""
    store = KvFileStore(root, 10**15, sharded=sharded, scan_snapshot=snapshot)
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
    return scan_s, lookup_lat, hits, store


def timed_find(root: Path, files: int) -> float:
    began = time.monotonic()
    found = subprocess.run(f"find {root} -type f | wc -l", shell=True, check=True,
                           capture_output=True, text=True).stdout.strip()
    seconds = time.monotonic() - began
    if int(found) < files:
        raise SystemExit(f"find counted {found} files, fewer than {files}")
    return seconds


def timed_adapter_start(root: Path) -> tuple[float, float]:
    """(seconds until stores resume, seconds until LMCache has heard of every key) from
    constructing kvpersist's LMCache adapter on ``root`` (after a clean stop of a store there,
    so a snapshot is adopted).  Stores resume when the store's index is complete; LMCache's
    byte accounting and LRU catch up afterwards on the adapter's announcement thread."""
    from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig

    store = KvFileStore(root, 10**15)
    store.open(background_scan=False)
    store.close()
    config = KvPersistL2AdapterConfig.from_dict({"path": str(root), "max_capacity_gb": 10**6})
    began = time.monotonic()
    adapter = KvPersistL2Adapter(config)
    while not adapter.store.scan_done:
        time.sleep(0.001)
    resumed = time.monotonic() - began
    if not adapter.wait_announced(600):
        raise SystemExit("LMCache was not told of every key within 600 s")
    announced = time.monotonic() - began
    usage = adapter.get_usage().total_bytes_used
    source = adapter.store.status()["scan_source"]
    used = adapter.store.used_bytes
    adapter.close()
    if source != "snapshot":
        raise SystemExit(f"the adapter's start did not adopt the snapshot ({source})")
    if usage != used:
        raise SystemExit(f"LMCache's usage {usage} is not the index's {used} bytes")
    return resumed, announced


def report(label: str, seconds: float, find_s: float, lookup_lat: list[float], hits: int) -> None:
    print(f"{label:<38}: {seconds:6.2f}s ({seconds / find_s:.2f}x find)")
    if lookup_lat:
        print(f"  lookups during it: {len(lookup_lat)} answered, {hits} hits, p50 "
              f"{1e6 * statistics.median(lookup_lat):.0f} us, max {1e6 * max(lookup_lat):.0f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--root", help="where to build the tree (default: a temp dir)")
    parser.add_argument("--sharded", action="store_true", help="two-level ab/cd/ layout")
    parser.add_argument("--keep", action="store_true", help="keep the generated tree")
    parser.add_argument("--python-walker", action="store_true",
                        help="also time the pure-Python walker (slow)")
    parser.add_argument("--through-adapter", action="store_true",
                        help="also time a start after a clean stop through kvpersist's LMCache "
                        "adapter: until stores resume, and until LMCache has been told of every "
                        "key (its byte accounting and LRU, caught up in the background)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of find and the start after a clean stop, side by side; "
                        "medians reported (default 3)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvp-scan-"))
    root.mkdir(parents=True, exist_ok=True)
    figures: dict[str, object] = {"files": args.files, "sharded": args.sharded}
    c_walker = inventory._walk
    try:
        if any(p for p in root.iterdir() if not p.name.startswith(".")):
            print(f"reusing the tree in {root}")
        else:
            print(f"generating {args.files} sparse files in {root} (sharded={args.sharded})")
            generate(root, args.files, args.sharded)
        find_s = timed_find(root, args.files)
        figures["find_s"] = find_s
        print(f"find -type f | wc -l : {args.files} files in {find_s:.2f}s")
        walkers = [("C walker", c_walker)] + ([("Python walker", None)]
                                              if args.python_walker else [])
        for label, walker in walkers:
            inventory._walk = walker
            scan_s, lat, hits, store = timed_scan(root, args.files, args.sharded, snapshot=False)
            store.close()
            figures[f"walk_{label.split()[0].lower()}_s"] = scan_s
            report(f"start after a crash, walk ({label})", scan_s, find_s, lat, hits)
        inventory._walk = c_walker
        _, _, _, store = timed_scan(root, args.files, args.sharded, snapshot=True)
        began = time.monotonic()
        store.close()  # a clean stop: walks once more and writes the snapshot
        close_s = time.monotonic() - began
        figures["clean_stop_s"] = close_s
        report("clean stop (walk + write the snapshot)", close_s, find_s, [], 0)
        # Rounds: find, then the start after a clean stop, side by side (this machine's timings
        # vary by a third from one run to the next; the ratio of medians is what is reported).
        rounds: dict[str, list[float]] = {"find_s": [], "start_after_clean_stop_s": [],
                                          "adapter_start_after_clean_stop_s": [],
                                          "adapter_announced_after_clean_stop_s": []}
        for _ in range(args.rounds):
            rounds["find_s"].append(timed_find(root, args.files))
            scan_s, lat, hits, store = timed_scan(root, args.files, args.sharded, snapshot=True)
            source = store.status()["scan_source"]
            store.close()  # leaves the snapshot the next start adopts
            if source != "snapshot":
                raise SystemExit("the start after a clean stop did not adopt the snapshot "
                                 f"({source})")
            rounds["start_after_clean_stop_s"].append(scan_s)
            if args.through_adapter:
                resumed_s, announced_s = timed_adapter_start(root)
                rounds["adapter_start_after_clean_stop_s"].append(resumed_s)
                rounds["adapter_announced_after_clean_stop_s"].append(announced_s)
        rounds = {k: v for k, v in rounds.items() if v}
        figures["rounds"] = rounds
        med = {k: statistics.median(v) for k, v in rounds.items()}
        figures.update(med)
        find_s = med["find_s"]
        print(f"median of {args.rounds} rounds: find {find_s:.2f}s")
        report("start after a clean stop (snapshot)", med["start_after_clean_stop_s"], find_s,
               [], 0)
        if args.through_adapter:
            report("the same through the LMCache adapter",
                   med["adapter_start_after_clean_stop_s"], find_s, [], 0)
            report("  ... until LMCache heard of every key",
                   med["adapter_announced_after_clean_stop_s"], find_s, [], 0)
    finally:
        inventory._walk = c_walker
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
