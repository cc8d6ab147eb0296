"""Benchmark (on demand, never in CI): KV produced faster than L2 absorbs it.

The synthetic-KV writer (:mod:`kvpersist.testing.kv_writer`) is the engine: a real LMCache
server with kvpersist's adapter takes its STOREs, with no vLLM in the way to slow them.  Each
case writes the same ``--gib`` of KV twice, side by side:

* **paced**: the writer waits whenever L2 is half an L1 behind it; nothing may be dropped, and
  bytes on L2 over seconds is the sustained store rate L2 gives;
* **unpaced**, as vLLM's stores are: the writer sends as fast as it can; what a full L1 cannot
  take is dropped by LMCache without an error (vLLM counts it as stored) and counted by
  kvpersist (``kvpersist_l1_stores_dropped_total``); L1's use is sampled while it runs.

The cases: a file system whose writes are throttled to ``--write-mib-s`` (cgroup v1 blkio on a
loop device; kvpersist writes L2 files with O_DIRECT, so the throttle applies), and the VM disk
as it is.  Needs root for the throttled case.

    .venv/bin/python benchmarks/bench_store_overload.py --gib 1 --l1-gb 0.25 --write-mib-s 64 \\
        --json benchmarks/results/store-overload.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvpersist.config.server import load_settings
from kvpersist.serving import http
from kvpersist.serving.launcher.vllm_client import metric_sum
from kvpersist.serving.lmcache_compat import status as server_status
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import slow_disk
from kvpersist.testing.helpers import server_env, wait_for_l2_idle
from kvpersist.testing.kv_writer import (
    CHUNK_TOKENS,
    EngineLayout,
    KvWriter,
    L2Pacer,
    seeded_fill,
)
from kvpersist.testing.processes import server_pid

#: 8 layers x 2 KV heads x 32, float32: 1 MiB a chunk (4 KiB of KV per token).
LAYOUT = EngineLayout("bench/overload/kvp-" + "c" * 32, 8, 2, 32, 128, torch.float32)
PER_STORE = 16  # chunks per STORE: 4,096 tokens, a long prefill step's worth


def l1_used_bytes(settings: Any) -> int:
    status = server_status.fetch(settings.http_url, timeout=10) or {}
    managers = server_status.storage_manager(status).get("l1_managers") or {}
    return int(sum(m.get("memory_used_bytes", 0) for m in managers.values()
                   if isinstance(m, dict)))


@contextlib.contextmanager
def sampled(settings: Any, every_s: float = 0.25) -> Iterator[list[int]]:
    """L1's bytes in use, sampled while the block runs."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(Exception):
                samples.append(l1_used_bytes(settings))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def one_write(root: Path, args: argparse.Namespace, paced: bool,
              admit: Any = None) -> dict[str, Any]:
    """A fresh server on ``root``; ``--gib`` of KV written paced or not; what reached L2."""
    settings = load_settings(server_env(root, KVP_L1_SIZE_GB=f"{args.l1_gb:g}",
                                        KVP_CACHE_BUDGET_GB=str(int(args.gib * 2) + 1)))
    chunks = int(args.gib * 2**30 // LAYOUT.chunk_bytes)
    l1_chunks = int(args.l1_gb * 2**30 // LAYOUT.chunk_bytes)
    ids = list(range(chunks * CHUNK_TOKENS))
    start_server(settings)
    try:
        if admit is not None:
            admit(server_pid(settings))
        pacer = L2Pacer(settings.l2_roots, l1_chunks // 2)
        began = time.monotonic()
        with sampled(settings) as l1_samples, \
                KvWriter(settings.request_url, LAYOUT, chunks_per_store=PER_STORE) as writer:
            acked = writer.write(ids, seeded_fill(5), between_stores=pacer if paced else None)
        acked_s = time.monotonic() - began
        adapter = wait_for_l2_idle(settings, timeout=3600)
        landed_s = time.monotonic() - began
        metrics = http.get(settings.http_url + "/metrics", timeout=10).body.decode()
    finally:
        stop_server(settings)
    landed = int(adapter["files"])
    dropped = int(metric_sum(metrics, "kvpersist_l1_stores_dropped_total"))
    return {"paced": paced, "chunks_sent": acked, "chunks_on_l2": landed,
            "chunks_dropped_counted": dropped,
            "dropped_bytes_counted": int(metric_sum(
                metrics, "kvpersist_l1_stores_dropped_bytes_total")),
            "sent_s": round(acked_s, 2), "on_l2_s": round(landed_s, 2),
            "sent_mib_s": round(acked * LAYOUT.chunk_bytes / 2**20 / acked_s, 1),
            "l2_mib_s": round(landed * LAYOUT.chunk_bytes / 2**20 / landed_s, 1),
            "l1_peak_fraction": round(max(l1_samples, default=0) / (args.l1_gb * 2**30), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="KV written per run (GiB)")
    parser.add_argument("--l1-gb", type=float, default=0.25, help="the server's L1 (GiB)")
    parser.add_argument("--write-mib-s", type=int, default=64,
                        help="the throttled file system's write rate (MiB/s)")
    parser.add_argument("--work", help="work directory on the VM disk (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-overload-"))
    results: dict[str, list[dict[str, Any]]] = {}
    why_not = slow_disk.unavailable()
    if why_not is None:
        size_mb = int(args.gib * 1024 * 2.5) + 256
        for paced in (True, False):
            with slow_disk.slow_disk(work / f"slow-{paced}", size_mb=size_mb,
                                     read_bytes_per_s=0) as disk:
                disk.set_write_rate(args.write_mib_s << 20)
                results.setdefault(f"throttled to {args.write_mib_s} MiB/s", []).append(
                    one_write(disk.mount / "cache", args, paced, admit=disk.admit))
    else:
        print(f"no throttled case: {why_not}")
    for paced in (True, False):
        results.setdefault("VM disk", []).append(
            one_write(work / f"disk-{paced}" / "cache", args, paced))
    print(json.dumps(results, indent=2))
    print(f"\n{'device':<24} {'paced':>5} {'sent':>5} {'on L2':>6} {'dropped':>8} "
          f"{'sent MiB/s':>10} {'L2 MiB/s':>9} {'L1 peak':>8}")
    for device, rows in results.items():
        for r in rows:
            print(f"{device:<24} {r['paced']!s:>5} {r['chunks_sent']:>5} {r['chunks_on_l2']:>6} "
                  f"{r['chunks_dropped_counted']:>8} {r['sent_mib_s']:>10} {r['l2_mib_s']:>9} "
                  f"{r['l1_peak_fraction']:>8}")
    if args.json:
        args.json.write_text(json.dumps({"l1_gb": args.l1_gb, "gib": args.gib,
                                         "chunk_bytes": LAYOUT.chunk_bytes,
                                         "results": results}, indent=2) + "\n")
    # Every chunk is accounted for: on L2, or counted as dropped.
    return 0 if all(r["chunks_on_l2"] + r["chunks_dropped_counted"] == r["chunks_sent"]
                    for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
