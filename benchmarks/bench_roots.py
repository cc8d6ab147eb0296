"""Benchmark (on demand, never in CI): a long chat restored from a tier of N roots, each on its
own throttled device, against one device and against a cold raw parallel read of the same files
in the same run.

For each N (1, 2, 4 by default) and round, N ext4 loop devices are made (images on tmpfs, so
the throttle is each device's only limit: ``testing.slow_disk.slow_disks``), every device
limited to the same read and write rate on its own, all in one blkio cgroup so one process
reading from all of them gets up to N times the rate, as from N drives.  The kvpersist server
runs with ``KVP_CACHE_ROOT`` on the first device and ``KVP_CACHE_EXTRA_ROOTS`` on the others,
admitted to the cgroup.  Then, as ``bench_restore.py`` does for one root:

* the store: LMCache's bench client stores one request; L1->L2 is timed from the STORE's
  acknowledgement until every chunk file is on a device; beside it, the raw write of the same
  bytes: N ``dd oflag=direct`` at once, one per device (kvpersist writes with O_DIRECT too);
* the server restarts, the page cache is dropped, and the same chunk files are read cold:
  N ``cat`` at once, each over one device's files, and, after another drop, 8 ``dd
  iflag=direct`` at a time over all of them; the faster is the raw parallel read;
* the page cache is dropped again and the request is restored (LOOKUP: LMCache's L2->L1 load;
  then RETRIEVE), checksums compared.

Printed per N: the L2->L1 rate, its ratio to N x the one-device rate of the same round (the
scaling), to the raw parallel read of the same files, and the placement's imbalance (the fullest
device's bytes over the mean: a restore cannot beat the fullest device, so with few chunks
rendezvous placement alone caps the scaling; a 1M-token chat has thousands of chunks).

An md RAID0 of the same devices and LMCache's ``raw_block`` (one device file per adapter) are
the issue's other comparisons; this machine's kernel has no md or device-mapper driver and no
``mdadm``, so where they are absent the script says so and leaves them out.

    sudo .venv/bin/python benchmarks/bench_roots.py [--devices 1,2,4] [--mb-s 50]
        [--tokens 1048576] [--kv-per-token 1024] [--rounds 3] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench_restore import MODEL, admit_server, data_files, raw_direct_read

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import free_port
from kvpersist.l2.restore_timeline import STEPS
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.plot import line_plot
from kvpersist.testing.slow_disk import SlowDisk, drop_caches, slow_disks, unavailable

MIB = 1 << 20
#: KV bytes per token of one KV head of 128 float16 values, K and V.
HEAD_BYTES = 2 * 128 * 2


def shape_spec(tokens: int, kv_per_token: int) -> tuple[str, int]:
    """LMCache's bench shape (2, blocks, 16, heads, 128):float16:1 for ``kv_per_token``: one
    layer, so small chunks (many of them, as a long chat has) stay possible."""
    heads = kv_per_token // HEAD_BYTES
    if heads < 1 or heads * HEAD_BYTES != kv_per_token:
        raise SystemExit(f"--kv-per-token must be a multiple of {HEAD_BYTES}")
    blocks = tokens // 16 + 16
    return f"(2,{blocks},16,{heads},128):float16:1", blocks


def md_unavailable() -> str | None:
    """Why an md RAID0 of the devices cannot be built here, or None."""
    if shutil.which("mdadm") is None:
        return "no mdadm"
    if not Path("/proc/mdstat").exists():
        return "no md driver in this kernel (/proc/mdstat absent)"
    return None


def in_group(disk: SlowDisk, cmd: list[str]) -> list[str]:
    """``cmd`` run from inside the throttled cgroup."""
    return ["bash", "-c", f'echo $$ > {disk.cgroup}/cgroup.procs && exec "$@"', "in-group", *cmd]


def run_all(cmds: list[list[str]]) -> float:
    """Seconds until every one of ``cmds``, started together, has finished."""
    began = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{proc.args!r}: {err.decode(errors='replace')}")
    return time.perf_counter() - began


class ReadWatch:
    """Samples the devices' read bytes (every 5 ms) from entry to exit: when the first and the
    last byte were read, as ``time.monotonic()`` values (None: nothing was read).  The
    restore's own origin (:attr:`TimedRestore.began`, the LOOKUP's send) is subtracted by the
    caller: the watch starts before the request is built and its destination zeroed, and the
    "before the first read" figures recorded before 2026-12-07 counted that time too."""

    def __init__(self, disks: list[SlowDisk]) -> None:
        self.disks = disks
        self.first_s: float | None = None
        self.last_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _total(self) -> int:
        return sum(disk.read_bytes() for disk in self.disks)

    def _sample(self) -> None:
        seen = self._total()
        while not self._stop.wait(0.005):
            now = self._total()
            if now != seen:
                at = time.monotonic()
                self.first_s = at if self.first_s is None else self.first_s
                self.last_s, seen = at, now

    def __enter__(self) -> ReadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def raw_parallel_write(disks: list[SlowDisk], nbytes: int) -> float:
    """Seconds to write ``nbytes`` spread evenly over ``disks``, one O_DIRECT ``dd`` per device
    at once; the files are removed after."""
    count = -(-nbytes // len(disks) // (16 * MIB))
    targets = [disk.mount / "raw-write.bin" for disk in disks]
    try:
        return run_all([in_group(disks[0], ["dd", "if=/dev/zero", f"of={t}", "bs=16M",
                                            f"count={count}", "oflag=direct", "status=none"])
                        for t in targets])
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def raw_parallel_cat(disks: list[SlowDisk], files: dict[Path, list[Path]]) -> float:
    """Seconds for one buffered ``cat`` per device over that device's files, all at once."""
    return run_all([in_group(disks[0], ["cat", *map(str, files[d.mount])])
                    for d in disks if files[d.mount]])


def raw_parallel_reads(disks: list[SlowDisk], files: dict[Path, list[Path]]) -> tuple[float, float]:
    """The cold raw reads of ``files`` (device mount -> its files), page cache dropped before
    each: seconds of a ``cat`` per device at once, and of 8 O_DIRECT ``dd`` at a time over all
    of them; the faster is the raw parallel read a restore is set against."""
    drop_caches()
    cat_s = raw_parallel_cat(disks, files)
    drop_caches()
    return cat_s, raw_direct_read([p for paths in files.values() for p in paths], disks[0])


def settings_for(roots: list[Path], l1_gb: float) -> ServerSettings:
    return load_settings({
        "KVP_CACHE_ROOT": str(roots[0]),
        "KVP_CACHE_EXTRA_ROOTS": ":".join(map(str, roots[1:])),
        "KVP_ZMQ_PORT": str(free_port()), "KVP_HTTP_PORT": str(free_port()),
        "KVP_L1_SIZE_GB": str(l1_gb), "KVP_CACHE_BUDGET_GB": "200",
        # lmcache_driven: the bench client fetches checksums over plain HTTP (loopback TCP)
        "KVP_ACCESS": "tcp",
        # the LOOKUP loads the whole request (L1 sized for it): L2->L1 measured apart
        "KVP_RESTORE_WINDOW_GB": "0"})


@contextlib.contextmanager
def running(settings: ServerSettings, disks: list[SlowDisk]) -> Iterator[None]:
    start_server(settings)
    try:
        admit_server(settings, disks[0])  # one cgroup: throttled on every device
        yield
    finally:
        stop_server(settings)


def one_round(work: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    chunks = args.tokens // 256
    nbytes = chunks * 256 * args.kv_per_token
    size_mb = (2 * nbytes // n + nbytes // 4) // MIB + 256  # chunks + the raw write + slack
    rate = int(args.mb_s * MIB)
    spec, blocks = shape_spec(args.tokens, args.kv_per_token)
    with slow_disks(work, n, size_mb=size_mb, read_bytes_per_s=rate,
                    write_bytes_per_s=rate) as disks:
        roots = [d.mount / "kv" for d in disks]
        for root in roots:
            root.mkdir(mode=0o700)
        settings = settings_for(roots, args.l1_gb)
        with running(settings, disks):
            d = BenchDriver(settings.request_url, settings.http_url, MODEL,
                            num_tokens=args.tokens, shape_spec=spec, num_blocks=blocks,
                            transfer_mode="lmcache_driven")
            if not d.store(0):
                raise RuntimeError(f"N={n}: the store was refused")
            acked = time.perf_counter()
            while (stored := sum(len(data_files(r, "kvpersist")) for r in roots)) < chunks:
                if time.perf_counter() - acked > 900:
                    raise RuntimeError(f"N={n}: {stored}/{chunks} chunks stored")
                time.sleep(0.01)
            l1_to_l2_s = time.perf_counter() - acked
            sums = d.checksums(0)
            d.close()
        raw_write_s = raw_parallel_write(disks, nbytes)
        by_device = {disk.mount: data_files(root, "kvpersist")
                     for disk, root in zip(disks, roots, strict=True)}
        device_bytes = [sum(p.stat().st_size for p in files) for files in by_device.values()]
        with running(settings, disks):
            raw_cat_s, raw_direct_s = raw_parallel_reads(disks, by_device)
            drop_caches()
            read_before = [disk.read_bytes() for disk in disks]
            d = BenchDriver(settings.request_url, settings.http_url, MODEL,
                            num_tokens=args.tokens, shape_spec=spec, num_blocks=blocks,
                            transfer_mode="lmcache_driven")
            with ReadWatch(disks) as watch:
                trip = d.timed_restore(0, sums)
            d.close()
            steps = adapter_steps(settings, trip.began)
            read_by_restore = [disk.read_bytes() - b for disk, b in zip(disks, read_before, strict=True)]
    mean = sum(device_bytes) / n
    return {"devices": n, "ok": trip.ok, "hit_chunks": trip.hit_chunks, "chunks": chunks,
            "payload_bytes": nbytes, "file_bytes": sum(device_bytes),
            "device_file_bytes": device_bytes, "device_read_bytes": read_by_restore,
            "imbalance": max(device_bytes) / mean,
            "l1_to_l2_s": l1_to_l2_s, "raw_write_s": raw_write_s,
            "raw_cat_s": raw_cat_s, "raw_direct_s": raw_direct_s,
            "raw_read_s": min(raw_cat_s, raw_direct_s),
            "l2_to_l1_s": trip.lookup_s, "restore_s": trip.restore_s,
            # when the devices read, from the LOOKUP's start: the fixed cost's two ends
            "first_read_s": since(watch.first_s, trip.began),
            "last_read_s": since(watch.last_s, trip.began),
            # when the adapter passed each step of the restore, from the LOOKUP's send
            "adapter_steps_s": steps}


def adapter_steps(settings: ServerSettings, began: float) -> dict[str, float]:
    """The kvpersist adapter's ``last_restore_timeline`` (``kvpersist.l2.restore_timeline``)
    in seconds from ``began`` (the client's ``time.monotonic()`` at the LOOKUP's send)."""
    from kvpersist.testing.helpers import adapter_status

    timeline = adapter_status(settings).get("last_restore_timeline", {})
    return {step: at - began for step, at in timeline.items()}


def since(at: float | None, began: float) -> float | None:
    """Seconds from ``began`` to ``at`` (None stays None: nothing was read)."""
    return None if at is None else at - began


def summarize(rows: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Medians per N; the scaling is paired by round (N's rate / (N x the same round's
    one-device rate)) when N = 1 ran."""
    out = []
    ones = {r["round"]: r for r in rows if r["devices"] == 1}
    for n in counts:
        mine = [r for r in rows if r["devices"] == n]
        if not mine:
            continue
        gb = mine[0]["payload_bytes"] / 1e9

        def med(values: list[float]) -> float:
            return float(statistics.median(values))

        scaling = [ones[r["round"]]["l2_to_l1_s"] / (n * r["l2_to_l1_s"])
                   for r in mine if r["round"] in ones]
        store_scaling = [ones[r["round"]]["l1_to_l2_s"] / (n * r["l1_to_l2_s"])
                         for r in mine if r["round"] in ones]
        out.append({
            "devices": n, "rounds": len(mine), "ok": all(r["ok"] for r in mine),
            "l2_to_l1_s": med([r["l2_to_l1_s"] for r in mine]),
            "l2_to_l1_gb_s": gb / med([r["l2_to_l1_s"] for r in mine]),
            "raw_read_gb_s": gb / med([r["raw_read_s"] for r in mine]),
            "x_raw_read": med([r["raw_read_s"] / r["l2_to_l1_s"] for r in mine]),
            "excess_s": med([r["l2_to_l1_s"] - r["raw_read_s"] for r in mine]),
            # the LOOKUP's start to the first device read, and the last read to its end
            "before_reads_s": (med(v) if (v := [r["first_read_s"] for r in mine
                                                if r.get("first_read_s") is not None]) else None),
            "after_reads_s": (med(v) if (v := [r["l2_to_l1_s"] - r["last_read_s"] for r in mine
                                               if r.get("last_read_s") is not None]) else None),
            "adapter_steps_s": {step: med([r["adapter_steps_s"][step] for r in mine])
                                for step in STEPS
                                if all(step in r.get("adapter_steps_s", {}) for r in mine)},
            "x_n_one_device": med(scaling) if scaling else None,
            "store_gb_s": gb / med([r["l1_to_l2_s"] for r in mine]),
            "raw_write_gb_s": gb / med([r["raw_write_s"] for r in mine]),
            "x_raw_write": med([r["raw_write_s"] / r["l1_to_l2_s"] for r in mine]),
            "store_x_n_one_device": med(store_scaling) if store_scaling else None,
            "imbalance": med([r["imbalance"] for r in mine]),
        })
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report(rows: list[dict[str, Any]], counts: list[int], mb_s: float, json_out: Path | None,
           plot: Path | None) -> None:
    """Print the summary of ``rows``; write it (and them) to ``json_out`` and the plot."""
    summary = summarize(rows, counts)
    rounds = len({r["round"] for r in rows})
    gb = rows[0]["payload_bytes"] / 1e9
    tokens = rows[0]["chunks"] * 256
    print(f"\n{gb:.2f} GB chat ({tokens} tokens, {rows[0]['chunks']} chunks), each device "
          f"{mb_s:g} MiB/s read and write, median of {rounds} rounds, cold page cache")
    print(f"{'N':>2} {'ok':>5} {'L2->L1 GB/s':>12} {'x N*one':>8} {'raw GB/s':>9} "
          f"{'x raw read':>10} {'excess s':>9} {'store GB/s':>11} {'x N*one':>8} "
          f"{'x raw write':>11} {'imbalance':>9}")
    for s in summary:
        print(f"{s['devices']:>2} {s['ok']!s:>5} {s['l2_to_l1_gb_s']:>12.3f} "
              f"{fmt(s['x_n_one_device']):>8} {s['raw_read_gb_s']:>9.3f} {s['x_raw_read']:>10.2f} "
              f"{s['excess_s']:>9.2f} {s['store_gb_s']:>11.3f} "
              f"{fmt(s['store_x_n_one_device']):>8} {s['x_raw_write']:>11.2f} "
              f"{s['imbalance']:>9.3f}")
    if any(s.get("before_reads_s") is not None for s in summary):
        print("the LOOKUP's time outside the device reads (median s): "
              + "; ".join(f"N={s['devices']}: {fmt(s.get('before_reads_s'), '.3f')} before the "
                          f"first read, {fmt(s.get('after_reads_s'), '.3f')} after the last"
                          for s in summary))
    if any(s.get("adapter_steps_s") for s in summary):
        print("the adapter's steps, from the LOOKUP's send (median s): " + "; ".join(
            f"N={s['devices']}: " + ", ".join(f"{step} {at:.3f}"
                                              for step, at in s["adapter_steps_s"].items())
            for s in summary))
    print("(x N*one: this N's rate / N x the one-device rate of the same round; x raw read: "
          "the faster cold raw parallel read (a cat per device at once, or 8 O_DIRECT dd at a "
          "time) / L2->L1 time; excess: L2->L1 time - that raw read's, in seconds; x raw write: "
          "N O_DIRECT dd at once / L1->L2 time; imbalance: the fullest device's bytes / the "
          "mean)")
    why_md = md_unavailable()
    print(f"md RAID0 of the same devices: {'left out: ' + why_md if why_md else 'not run'}; "
          "raw_block: one device file per adapter, so it cannot use several devices "
          "(bench_restore.py measures it on one)")
    if json_out is not None:
        json_out.write_text(json.dumps(
            {"gb": gb, "tokens": tokens, "kv_per_token": rows[0]["payload_bytes"] // tokens,
             "mb_s_per_device": mb_s, "md_raid0": why_md or "not run",
             "summary": summary, "rounds": rows}, indent=2) + "\n")
    if plot is not None:
        one = next((s for s in summary if s["devices"] == 1), None)
        series: dict[str, Sequence[tuple[float, float]]] = {
                  "kvpersist L2->L1": [(s["devices"], s["l2_to_l1_gb_s"]) for s in summary],
                  "raw parallel read": [(s["devices"], s["raw_read_gb_s"]) for s in summary],
                  "kvpersist store": [(s["devices"], s["store_gb_s"]) for s in summary]}
        if one is not None:
            series["N x one device (L2->L1)"] = [(s["devices"], s["devices"] * one["l2_to_l1_gb_s"])
                                                 for s in summary]
        line_plot(plot, f"{gb:.2f} GB chat over N devices of {mb_s:g} MiB/s each, cold",
                  "devices", "GB/s", series)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1,2,4",
                        help="the device counts to run, comma separated (1 first: the scaling "
                        "is against it)")
    parser.add_argument("--mb-s", type=float, default=50.0,
                        help="each device's read and write limit in MiB/s (default 50: four "
                        "devices stay well under this machine's unthrottled software rate)")
    parser.add_argument("--tokens", type=int, default=1 << 20,
                        help="tokens of the chat (256 per chunk; default 1M: 4,096 chunks, as "
                        "many as a 1M-token chat has, so the placement's spread is a real one)")
    parser.add_argument("--kv-per-token", type=int, default=1024,
                        help="KV bytes per token, a multiple of 512 (default 1024: 256 KiB "
                        "chunks, 1 GiB in all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1-gb", type=float, default=3.0)
    parser.add_argument("--json", help="write the summary and the per-round results here")
    parser.add_argument("--plot", help="write GB/s against the device count (PNG) here")
    parser.add_argument("--report", metavar="JSON",
                        help="print (and --plot) the summary of a saved --json run; runs nothing")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(saved["rounds"], sorted({r["devices"] for r in saved["rounds"]}),
               saved["mb_s_per_device"], None, Path(args.plot) if args.plot else None)
        return 0
    why = unavailable()
    if why is not None:
        print(f"bench_roots: cannot make throttled devices here: {why}", file=sys.stderr)
        return 2
    counts = [int(c) for c in args.devices.split(",")]
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="kvp-roots-"))
    try:
        for r in range(args.rounds):
            for n in counts if r % 2 == 0 else counts[::-1]:
                row = {"round": r, **one_round(work / f"r{r}-n{n}", n, args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, counts, args.mb_s, Path(args.json) if args.json else None,
           Path(args.plot) if args.plot else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
