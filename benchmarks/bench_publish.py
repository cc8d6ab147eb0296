"""Benchmark (on demand, never in CI): what a rename per chunk costs kvpersist's stores.

kvpersist publishes each chunk atomically: an ``O_DIRECT`` write of header and payload to a
temporary name, then ``rename`` to the chunk's name (``kvpersist.l2.direct_write``).  A block
store such as LMCache's ``raw_block`` writes into a preallocated region with no file per chunk.
This measures, on one file system and side by side, the same ``--chunks`` chunk writes three ways:

* ``publish``: kvpersist's own ``publish_direct`` (temporary file, write, close, rename);
* ``no rename``: the same writes straight to the final names (what skipping atomic publish
  would save; never done by kvpersist);
* ``one file``: the same bytes written into one preallocated file at chunk offsets (a block
  store's pattern), so the per-file cost stands out.

Each way runs with ``--threads`` writers at once, as the adapter's file threads do, in
alternating order over ``--rounds`` rounds on a fresh directory.

    .venv/bin/python benchmarks/bench_publish.py --dir /var/tmp --chunks 512 --chunk-mib 4
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpersist.l2.direct_write import publish_direct
from kvpersist.l2.format import HEADER_SIZE


def aligned(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer (``O_DIRECT`` needs one)."""
    return mmap.mmap(-1, size)


_local = threading.local()


def bounce(size: int) -> memoryview:
    """This thread's page-aligned staging buffer, as each of the adapter's file threads has."""
    buffer: memoryview | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < size:
        buffer = _local.buffer = memoryview(aligned(size))
    return buffer


def way_publish(folder: Path, chunks: int, payload: memoryview, threads: int) -> None:
    header = b"\0" * HEADER_SIZE

    def one(i: int) -> None:
        publish_direct(folder / f"chunk-{i}.kvp", header, payload,
                       bounce(payload.nbytes + HEADER_SIZE), fsync=False)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(chunks)))


def way_no_rename(folder: Path, chunks: int, payload: memoryview, threads: int) -> None:
    size = payload.nbytes + HEADER_SIZE

    def one(i: int) -> None:
        staged = bounce(size)
        staged[HEADER_SIZE:size] = payload  # the same copy publish_direct makes
        fd = os.open(folder / f"chunk-{i}.kvp",
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, staged[:size], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(chunks)))


def way_one_file(folder: Path, chunks: int, payload: memoryview, threads: int) -> None:
    size = payload.nbytes + HEADER_SIZE
    block = aligned(size)
    fd = os.open(folder / "region", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size * chunks)

        def one(i: int) -> None:
            os.pwrite(fd, block, i * size)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(chunks)))
    finally:
        os.close(fd)


WAYS = {"publish": way_publish, "no rename": way_no_rename, "one file": way_one_file}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a directory on the file system to measure (default: %(default)s)")
    parser.add_argument("--chunks", type=int, default=512)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    payload = memoryview(aligned(args.chunk_mib << 20))
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for round_ in range(args.rounds):
        order = list(WAYS) if round_ % 2 == 0 else list(WAYS)[::-1]
        for name in order:
            folder = Path(tempfile.mkdtemp(prefix="kvp-publish-", dir=args.dir))
            try:
                os.sync()
                began = time.monotonic()
                WAYS[name](folder, args.chunks, payload, args.threads)
                os.sync()  # the data and the names on the device, for every way alike
                times[name].append(time.monotonic() - began)
            finally:
                shutil.rmtree(folder)
    gib = args.chunks * args.chunk_mib / 1024
    result = {name: {"median_s": round(statistics.median(t), 3),
                     "rounds_s": [round(x, 3) for x in t],
                     "gib_s": round(gib / statistics.median(t), 2)}
              for name, t in times.items()}
    base = result["one file"]["median_s"]
    for row in result.values():
        row["x_one_file"] = round(row["median_s"] / base, 2)
    print(json.dumps({"dir": args.dir, "chunks": args.chunks, "chunk_mib": args.chunk_mib,
                      "threads": args.threads, "ways": result}, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"dir": args.dir, "chunks": args.chunks,
                                         "chunk_mib": args.chunk_mib, "threads": args.threads,
                                         "ways": result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
