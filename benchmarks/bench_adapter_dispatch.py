"""The L2 adapter's own share of a restore's fixed cost: from LMCache's lookup of a chat's keys to
the adapter's first file read, with several roots.

A restore of a long chat spends a fixed 0.2-0.4 s before its first device read (docs:
"Several drives"). The adapter's part of it is the lookup of every key in the roots' indexes and
the load's dispatch of every file to its root's threads; with several roots each asks the
rendezvous hash where a key lives. This runs the adapter in-process on files in ``/dev/shm``
(no device time) and times, per round and alternating: the lookup task of ``--chunks`` keys, the
load task's submission to its first read, and the whole load, with the roots' order of each key
kept between the lookup and the load (now) and recomputed at every step (before).

    .venv/bin/python benchmarks/bench_adapter_dispatch.py --chunks 4096 --roots 4 --rounds 5

Prints the medians per way and their ratios; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.l2 import roots as roots_module
from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig, to_object_key
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.helpers import key_of, wait_for_task

WAYS = {"kept": roots_module.RANK_CACHE_KEYS, "recomputed": 0}


class _Chunk:
    def __init__(self, size: int) -> None:
        self.byte_array = bytearray(size)


def one_round(way: str, chunks: int, roots: int, chunk_bytes: int) -> dict[str, float]:
    """A fresh adapter (so no key's order is known before its lookup) over ``roots`` roots."""
    roots_module.RANK_CACHE_KEYS = WAYS[way]
    top = Path(tempfile.mkdtemp(prefix="kvp-dispatch-", dir="/dev/shm"))
    paths = [top / f"root{i}" for i in range(roots)]
    for p in paths:
        p.mkdir()
    adapter = KvPersistL2Adapter(KvPersistL2AdapterConfig(
        str(paths[0]), 8.0, extra_paths=tuple(str(p) for p in paths[1:])))
    first_read: list[float] = []
    real_read = KvFileStore.read_into

    def timed_read(self: KvFileStore, key: Any, buf: Any, lease: Any = None) -> bool:
        if not first_read:
            first_read.append(time.perf_counter())
        return real_read(self, key, buf, lease)

    try:
        assert adapter.store.wait_scan(60)
        keys = [key_of(i) for i in range(chunks)]
        for k in keys:
            assert adapter.store.put(k, bytes(chunk_bytes)) == "stored"
        adapter.close()  # reopen: the orders the puts computed are gone, as after a restart
        adapter = KvPersistL2Adapter(KvPersistL2AdapterConfig(
            str(paths[0]), 8.0, extra_paths=tuple(str(p) for p in paths[1:])))
        assert adapter.store.wait_scan(60)
        object_keys = [to_object_key(k) for k in keys]
        KvFileStore.read_into = timed_read  # type: ignore[method-assign]
        t0 = time.perf_counter()
        tid = adapter.submit_lookup_and_lock_task(object_keys, {})
        hits = wait_for_task(adapter.get_lookup_and_lock_event_fd(),
                             adapter.query_lookup_and_lock_result, tid, timeout=600)
        t1 = time.perf_counter()
        objects = [_Chunk(chunk_bytes) for _ in keys]
        t2 = time.perf_counter()
        tid = adapter.submit_load_task(object_keys, objects)
        loaded = wait_for_task(adapter.get_load_event_fd(), adapter.query_load_result, tid,
                               timeout=600)
        t3 = time.perf_counter()
        if not all(hits.test(i) and loaded.test(i) for i in range(chunks)):
            raise SystemExit(f"{way}: not every chunk was found and loaded")
        return {"lookup_s": t1 - t0, "to_first_read_s": first_read[0] - t2,
                "load_s": t3 - t2}
    finally:
        KvFileStore.read_into = real_read  # type: ignore[method-assign]
        adapter.close()
        for p in sorted(top.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        top.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=4096, help="keys in the chat")
    parser.add_argument("--roots", type=int, default=4)
    parser.add_argument("--chunk-kib", type=int, default=16,
                        help="file size (small: this measures dispatch, not reads)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per way, alternating")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    samples: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
        for way in order:
            samples[way].append(one_round(way, args.chunks, args.roots, args.chunk_kib * 1024))
    medians = {w: {m: statistics.median(s[m] for s in samples[w]) for m in samples[w][0]}
               for w in WAYS}
    print(f"{args.chunks} keys on {args.roots} roots, median of {args.rounds} rounds (ms):")
    print(f"{'way':<11} {'lookup':>8} {'to 1st read':>12} {'load':>8}")
    for w, m in medians.items():
        print(f"{w:<11} {1e3 * m['lookup_s']:8.1f} {1e3 * m['to_first_read_s']:12.1f} "
              f"{1e3 * m['load_s']:8.1f}")
    ratios = {m: medians["recomputed"][m] / medians["kept"][m] for m in medians["kept"]}
    print("recomputed / kept: " + ", ".join(f"{m} {v:.2f}x" for m, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "samples": samples, "medians": medians,
                                         "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
