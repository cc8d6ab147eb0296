"""Benchmark (on demand, never in CI): kvpersist's verified L2 read, buffered and O_DIRECT,
against raw reads of the same files in the same run, on the VM's disk and on a RAM-backed block
device (a loop device over a file in /dev/shm, ext4), with the page cache dropped before each
pass.  The RAM device takes the disk out of the picture: what is left is what our code costs.

Every reader uses the same threads and page-aligned buffers (LMCache's L1 objects are 4096-byte
aligned), and reads every file whole:

- ``raw buffered`` / ``raw direct``: ``os.preadv`` of the whole file, nothing checked;
- ``kvpersist buffered`` / ``kvpersist direct``: ``KvFileStore.read_into`` (header, key, size
  and xxh3 of the payload checked; ``direct_io`` off / on).

And the write path, the same bytes on the same threads, each pass ending on ``sync`` (timed), so
the device has the bytes:

- ``raw write``: one ``pwritev`` of header-sized zeros and the payload into a new file;
- ``kvpersist store``: ``KvFileStore.put`` (xxh3 of the payload, header, temp file, rename).

    sudo .venv/bin/python benchmarks/bench_read_path.py --files 64 --mib 16 \\
        --json benchmarks/results/read-path.json --plot benchmarks/results/read-path.png

Passes alternate between the readers (``--repeats`` rounds) and the best pass of each is kept.
Needs root for dropping the page cache and for the loop device (``--devices disk`` without it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvpersist.l2.layout import KeyFields
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.plot import bar_plot
from kvpersist.testing.slow_disk import drop_caches

NS = "kvp-" + "b" * 32
READERS = ("raw buffered", "raw direct", "kvpersist buffered", "kvpersist direct")
WRITERS = ("raw write", "kvpersist store")


def key(i: int) -> KeyFields:
    return KeyFields(f"bench/model/{NS}", 0x01000100, 0, i.to_bytes(32, "big"), "")


@contextlib.contextmanager
def ram_device(gib: float) -> Iterator[Path]:
    """An ext4 file system on a loop device over a file in /dev/shm, mounted; removed after."""
    work = Path(tempfile.mkdtemp(prefix="kvp-ramdev-"))
    backing = Path(tempfile.mkdtemp(dir="/dev/shm")) / "disk.img"
    with backing.open("wb") as f:
        f.truncate(int(gib * 2**30))
    loop = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
        subprocess.run(["mount", loop, str(work)], check=True)
        try:
            yield work
        finally:
            subprocess.run(["umount", str(work)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)
        backing.unlink()
        backing.parent.rmdir()
        work.rmdir()


def buffers(count: int, size: int) -> list[memoryview]:
    return [memoryview(mmap.mmap(-1, size)) for _ in range(count)]


def raw_reader(paths: list[Path], direct: bool) -> Callable[[int, memoryview], int]:
    def read(i: int, out: memoryview) -> int:
        fd = os.open(paths[i], os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            total = 0
            while total < out.nbytes:
                n = os.preadv(fd, [out[total:]], total)
                if n <= 0:
                    break
                total += n
            return total
        finally:
            os.close(fd)
    return read


def timed_pass(read: Callable[[int, memoryview], int], bufs: list[memoryview], count: int,
               threads: int) -> float:
    """Seconds to read ``count`` files on ``threads`` threads, page cache dropped first."""
    drop_caches()
    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda i: read(i, bufs[i % len(bufs)]), range(count)))
    elapsed = time.monotonic() - began
    if not all(results):
        raise RuntimeError("a read failed: the benchmark would measure misses")
    return elapsed


def timed_writes(write: Callable[[int], bool], count: int, threads: int) -> float:
    """Seconds to write ``count`` files on ``threads`` threads and ``sync`` them."""
    os.sync()  # the previous pass's dirty pages are not this pass's cost
    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(write, range(count)))
    os.sync()
    elapsed = time.monotonic() - began
    if not all(results):
        raise RuntimeError("a write failed")
    return elapsed


def write_passes(root: Path, data: bytes, args: argparse.Namespace) -> dict[str, float]:
    """The best seconds of each writer over ``--repeats`` alternating passes."""
    header = bytes(4096)
    best: dict[str, float] = {}
    for n in range(args.repeats):
        for writer in WRITERS:
            target = root / f"write-{writer.split()[0]}-{n}"
            target.mkdir()
            if writer == "raw write":
                def write(i: int, target: Path = target) -> bool:
                    fd = os.open(target / f"{i}.raw", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        return os.pwritev(fd, [header, data], 0) == len(header) + len(data)
                    finally:
                        os.close(fd)
                seconds = timed_writes(write, args.files, args.threads)
            else:
                store = KvFileStore(target, 10**13, scan_snapshot=False)
                store.open(background_scan=False)
                try:
                    seconds = timed_writes(lambda i, s=store: s.put(key(i), data) == "stored",
                                           args.files, args.threads)
                finally:
                    store.close()
            best[writer] = min(best.get(writer, seconds), seconds)
            subprocess.run(["rm", "-rf", str(target)], check=True)
    return best


def run_device(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    size = args.mib << 20
    store = KvFileStore(root / "cache", 10**13)
    store.open(background_scan=False)
    try:
        data = os.urandom(size)
        for i in range(args.files):
            if store.put(key(i), data) != "stored":
                raise RuntimeError(f"store {i} was refused")
        paths = [store.path_for(key(i)) for i in range(args.files)]

        def verified(direct: bool) -> Callable[[int, memoryview], int]:
            def read(i: int, out: memoryview) -> int:
                return int(store.read_into(key(i), out))
            store.direct_io = direct  # passes run one at a time: the pass's mode holds
            return read

        file_bufs = buffers(args.threads, size + 4096)  # raw reads take header and payload
        payload_bufs = [b[:size] for b in buffers(args.threads, size)]
        best: dict[str, float] = {}
        still_direct = True
        for _ in range(args.repeats):
            for reader in READERS:
                if reader.startswith("raw"):
                    read, bufs = raw_reader(paths, reader.endswith("direct")), file_bufs
                else:
                    read, bufs = verified(reader.endswith("direct")), payload_bufs
                seconds = timed_pass(read, bufs, args.files, args.threads)
                if reader == "kvpersist direct":
                    still_direct = still_direct and store.direct_io
                best[reader] = min(best.get(reader, seconds), seconds)
        verify_s = store.status().get("verify_seconds")
        best.update(write_passes(root, data, args))
    finally:
        store.close()
    gib = args.files * size / 2**30
    rates = {reader: gib / seconds for reader, seconds in best.items()}
    return {"device": name, "files": args.files, "file_mib": args.mib, "gib": round(gib, 3),
            "threads": args.threads, "gib_per_s": {r: round(v, 3) for r, v in rates.items()},
            "seconds": {r: round(v, 3) for r, v in best.items()},
            "direct_stayed_on": still_direct,
            "kvpersist_direct_over_buffered": round(rates["kvpersist direct"]
                                                    / rates["kvpersist buffered"], 3),
            "kvpersist_best_over_raw_best": round(
                max(rates["kvpersist direct"], rates["kvpersist buffered"])
                / max(rates["raw direct"], rates["raw buffered"]), 3),
            "kvpersist_store_over_raw_write": round(rates["kvpersist store"]
                                                    / rates["raw write"], 3),
            "verify_seconds_total": verify_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=64, help="files per pass")
    parser.add_argument("--mib", type=int, default=16, help="payload MiB per file (a chunk)")
    parser.add_argument("--threads", type=int, default=16, help="files read at once "
                        "(the adapter's file_threads default)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the four readers")
    parser.add_argument("--devices", default="disk,ram", help="disk (a temp dir under --disk-dir), "
                        "ram (ext4 on a loop device over /dev/shm)")
    parser.add_argument("--disk-dir", default="/var/tmp", help="a directory on the VM's disk")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) here")
    args = parser.parse_args()
    results = []
    for device in args.devices.split(","):
        if device == "disk":
            with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
                results.append(run_device("VM disk", Path(d), args))
        elif device == "ram":
            gib = 2 * args.files * (args.mib + 1) / 1024 * 1.2 + 0.5  # read set + a write pass
            with ram_device(gib) as root:
                results.append(run_device("RAM loop device", root, args))
        else:
            parser.error(f"unknown device {device!r}")
    print(json.dumps(results, indent=2))
    columns = READERS + WRITERS
    print(f"\n{'device':<16} " + " ".join(f"{r:>19}" for r in columns) + "   (GiB/s)")
    for r in results:
        print(f"{r['device']:<16} " + " ".join(f"{r['gib_per_s'][k]:>19.2f}" for k in columns))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        bar_plot(args.plot, f"Reading (page cache dropped) and writing (synced) {args.files} x "
                 f"{args.mib} MiB files, {args.threads} threads", "GiB/s",
                 {r["device"]: r["gib_per_s"] for r in results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
