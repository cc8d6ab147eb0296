"""Benchmark (on demand, never in CI): restoring one long request from L2 after a server restart
with a cold page cache, for kvpersist's adapter and its peers, against a cold raw read of the
same files in the same run.

For each adapter (kvpersist, LMCache's nixl_store_dynamic, fs, fs_native and raw_block), one
after another on the same disk: LMCache's own bench client stores one request of ``--tokens``
tokens at ``--kv-per-token`` bytes (the store counts until every L2 file is on disk; the store
against a raw write of the same bytes is ``bench_read_path.py``'s, synced, since a ``dd`` into
the page cache varied fourfold between rounds); the server restarts; the page cache is
dropped and the L2 files are read once with ``cat`` (the cold raw read); the page cache is
dropped again and the request is restored: LOOKUP (on the server this includes the L2→L1 load)
then RETRIEVE (L1→client through shared memory, LMCache's lmcache_driven, the CPU default), checksums
compared.  Ratios are against the cold raw reads measured in the same round.
``raw_block`` writes one pre-sized image file (its "device") instead of a file per chunk: its
stores are counted from the server's status, and its raw read is a ``dd iflag=direct`` of the
bytes it used.  With ``--ram-device-mb`` everything runs on an ext4 loop device over a file in
``/dev/shm`` (the disk is then not the limit: what is left is the software's cost).  Needs root
(drop_caches).

Variants of kvpersist run beside its default (O_DIRECT reads, every read verified):
``kvpersist-buffered`` reads through the page cache (``KVP_L2_DIRECT_IO=false``), and
``kvpersist-noverify`` / ``kvpersist-buffered-noverify`` are a benchmark-only build of the same
server whose payload digest is a no-op (a ``sitecustomize`` put on the server's ``PYTHONPATH`` by
this script; the product has no such switch), so the cost of verification is the difference.

The raw reads of each round, each after dropping the page cache: ``cat`` of the files (buffered,
one stream), ``dd iflag=direct bs=16M`` of the same files, 8 at a time (as many reads in
flight as the adapters' I/O threads), and, where ``fio`` is installed, one ``fio`` O_DIRECT pass
over them (libaio, 1 MiB blocks, 32 in flight: the device's own limit for those files).  Ratios
are taken against the fastest of them.

    .venv/bin/python benchmarks/bench_restore.py [--root DIR] [--tokens 8192]
        [--kv-per-token 32768] [--rounds 3] [--adapters kvpersist,nixl_store_dynamic,fs,...]
        [--slow-disk-mb-s 200 | --ram-device-mb 6144]
        [--transfer-mode engine_driven|lmcache_driven] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import free_port
from kvpersist.serving.lmcache_compat import status as server_status
from kvpersist.serving.pidfile import check_pid_file
from kvpersist.serving.server import lifecycle as server_module
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.plot import bar_plot
from kvpersist.testing.slow_disk import SlowDisk, drop_caches, slow_disk

SUFFIX = {"kvpersist": ".kvp", "nixl_store_dynamic": ".bin", "fs": "", "fs_native": ".data"}
ADAPTERS = ("kvpersist", "kvpersist-buffered", "kvpersist-noverify", "nixl_store_dynamic", "fs",
            "fs_native", "raw_block")
#: Variant → (LMCache adapter it runs, extra server environment).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "kvpersist-buffered": ("kvpersist", {"KVP_L2_DIRECT_IO": "false"}),
    "kvpersist-noverify": ("kvpersist", {}),
    "kvpersist-buffered-noverify": ("kvpersist", {"KVP_L2_DIRECT_IO": "false"}),
}
#: Benchmark only: the server's payload reads skip the digest and return one that compares equal
#: to any checksum, so every other step of the read (header, key, length checks) still runs.
NO_VERIFY_SITECUSTOMIZE = """\
import kvpersist.l2.files as _files
from kvpersist.l2 import read_loop as _read_loop


class _AnyChecksum:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


def _read_unhashed(fd, out, offset, segment, counter=None, bounce=None):
    # the same reads, no digest (an unaligned O_DIRECT buffer keeps the real path)
    if bounce is not None and not (_read_loop.is_page_aligned(out)
                                   and out.nbytes % _read_loop.PAGE == 0):
        return _read_loop.read_hashed(fd, out, offset, segment, counter, bounce)
    return _read_loop.read_counted(fd, out, offset, segment, counter), _AnyChecksum(), 0.0


_files.read_hashed = _read_unhashed
"""
RAW_BLOCK_IMAGE = "raw_block.img"
RAW_BLOCK_META = 256 << 20  # raw_block's default meta_total_bytes: its slots start there
PAGE = 4096
MODEL = "bench/restore/kvp-" + "9" * 32


def shape_spec(tokens: int, kv_per_token: int) -> tuple[str, int]:
    """LMCache's bench shape (2, blocks, 16, heads, 128):float16:layers for ``kv_per_token``."""
    per_layer_head = 2 * 128 * 2  # K and V, head size 128, float16
    heads = 8
    layers = kv_per_token // (per_layer_head * heads)
    if layers < 1 or layers * per_layer_head * heads != kv_per_token:
        raise SystemExit(f"--kv-per-token must be a multiple of {per_layer_head * heads}")
    blocks = tokens // 16 + 16
    return f"(2,{blocks},16,{heads},128):float16:{layers}", blocks


def base_adapter(variant: str) -> str:
    return VARIANTS.get(variant, (variant, {}))[0]


def server_env(variant: str, scratch: Path) -> dict[str, str] | None:
    """The server's environment for ``variant`` (None: the ordinary one)."""
    if variant not in VARIANTS:
        return None
    env = {**os.environ, **VARIANTS[variant][1]}
    if variant.endswith("-noverify"):
        site = scratch / "noverify-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(NO_VERIFY_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def raw_direct_read(paths: list[Path], disk: SlowDisk | None) -> float:
    """Seconds of an O_DIRECT read of ``paths``, 8 ``dd iflag=direct bs=16M`` at a time."""
    script = ('printf "%s\\0" "$@" | xargs -0 -P 8 -I{} '
              'dd if={} of=/dev/null bs=16M iflag=direct status=none')
    return timed(["bash", "-c", script, "raw", *map(str, paths)], disk)


def raw_fio_read(paths: list[Path], disk: SlowDisk | None, *, offset: int = 0,
                 size: int | None = None) -> float | None:
    """Seconds ``fio`` reports for one O_DIRECT pass over ``paths`` (libaio, 1 MiB blocks, 32
    in flight: the device's limit rather than a tool's), or None where fio is not installed.
    ``offset``/``size`` select a region of a single file (``raw_block``'s slots)."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=raw", "--rw=read", "--bs=1M", "--direct=1", "--ioengine=libaio",
           "--iodepth=32", "--output-format=json"]
    # fio takes at most 4096 characters of file names: a directory of hard links to the same
    # inodes (same bytes, same device; nothing is read making them) stands for many files
    links = paths[0].parent.parent / "fio-links"
    if len(paths) > 1:
        links.mkdir()
        for i, path in enumerate(paths):
            os.link(path, links / f"{i:06d}")
        cmd.append(f"--opendir={links}")
    else:
        cmd.append(f"--filename={paths[0]}")
    if size is not None:
        cmd += [f"--offset={offset}", f"--size={size}"]
    if disk is not None:
        cmd = ["bash", "-c", f'echo $$ > {disk.cgroup}/cgroup.procs && exec "$@"', "fio", *cmd]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(links, ignore_errors=True)
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return float(job["runtime"]) / 1000.0


def data_files(root: Path, adapter: str) -> list[Path]:
    skip = {"lmcache-server.log", "lmcache-server.pid", ".kvpersist.lock", "raw.bin",
            RAW_BLOCK_IMAGE}
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip
                  and not {"quarantine", "run", ".kvpersist-state"} & set(p.parts)
                  and p.name.endswith(SUFFIX[base_adapter(adapter)]))


def raw_block_slot_bytes(kv_per_token: int) -> int:
    """One 256-token chunk, rounded up to a page, after raw_block's one-page header."""
    return -(-256 * kv_per_token // PAGE) * PAGE + PAGE


def raw_block_config(root: Path, chunks: int, kv_per_token: int) -> dict[str, Any]:
    """LMCache's raw_block adapter on a pre-sized image file under ``root`` (its device)."""
    slot = raw_block_slot_bytes(kv_per_token)
    image = root / RAW_BLOCK_IMAGE
    with image.open("wb") as fh:
        fh.truncate(RAW_BLOCK_META + (chunks + 8) * slot)
    return {"type": "raw_block", "device_path": str(image), "slot_bytes": slot,
            "use_odirect": True, "io_engine": "posix", "persist_enabled": True}


def raw_block_stored(settings: ServerSettings) -> int:
    """Chunks the raw_block adapter has indexed, from the server's status."""
    status = server_status.fetch(settings.http_url, timeout=10) or {}
    adapters = server_status.l2_adapters(status)
    core = adapters[0].get("core", {}) if adapters else {}
    return int(core.get("indexed_key_count", 0)) if isinstance(core, dict) else 0


def adapter_counters(settings: ServerSettings) -> dict[str, Any]:
    """The kvpersist adapter's status (its load and verify seconds since the server started)."""
    status = server_status.fetch(settings.http_url, timeout=10) or {}
    adapters = server_status.l2_adapters(status)
    return dict(adapters[0]) if adapters else {}


def stored_chunks(adapter: str, root: Path, settings: ServerSettings) -> int:
    if adapter == "raw_block":
        return raw_block_stored(settings)
    return len(data_files(root, adapter))


def adapter_config_with(raw_block: dict[str, Any] | None) -> None:
    """The server is started with ``raw_block`` as its L2 adapter JSON when given (raw_block
    needs a device path and slot size no kvpersist setting has; benchmark only)."""
    configured = ORIGINAL_ADAPTER_CONFIG
    server_module.l2_adapter_config = (  # type: ignore[attr-defined]
        configured if raw_block is None else (lambda settings: raw_block))


ORIGINAL_ADAPTER_CONFIG = server_module.l2_adapter_config  # type: ignore[attr-defined]


def timed(cmd: list[str], disk: SlowDisk | None = None) -> float:
    """Seconds ``cmd`` takes; run inside the slow disk's cgroup when there is one."""
    if disk is not None:
        cmd = ["bash", "-c", f'echo $$ > {disk.cgroup}/cgroup.procs && exec "$@"', "timed", *cmd]
    began = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


def admit_server(settings: ServerSettings, disk: SlowDisk | None) -> None:
    record = check_pid_file(settings.pid_file).record
    if disk is not None and record is not None:
        disk.admit(record.pid)


def one_round(adapter: str, root: Path, tokens: int, kv_per_token: int, l1_gb: float,
              transfer_mode: str, disk: SlowDisk | None) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, mode=0o700)
    kind = base_adapter(adapter)
    settings: ServerSettings = load_settings({
        "KVP_CACHE_ROOT": str(root), "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": str(l1_gb),
        "KVP_CACHE_BUDGET_GB": "200", **VARIANTS.get(adapter, ("", {}))[1],
        # lmcache_driven: the bench client asks the server's HTTP API for checksums over plain
        # HTTP, which cannot reach a Unix socket; loopback TCP then (a benchmark, on 127.0.0.1)
        **({"KVP_ACCESS": "tcp"} if transfer_mode == "lmcache_driven" else {}),
        # no streaming through L1 windows: the LOOKUP loads the whole request from L2 (L1 is
        # sized for it), so L2->L1 is measured apart from L1->client
        "KVP_RESTORE_WINDOW_GB": "0",
        "KVP_L2_ADAPTER": "fs" if kind == "raw_block" else kind})
    env = server_env(adapter, root.parent)
    spec, blocks = shape_spec(tokens, kv_per_token)
    nbytes = tokens // 256 * 256 * kv_per_token
    chunks = tokens // 256
    adapter_config_with(raw_block_config(root, chunks, kv_per_token)
                        if kind == "raw_block" else None)
    start_server(settings, env=env)
    try:
        d = BenchDriver(settings.request_url, settings.http_url, MODEL,
                        num_tokens=tokens, shape_spec=spec, num_blocks=blocks,
                        transfer_mode=transfer_mode)
        began = time.perf_counter()
        if not d.store(0):
            raise RuntimeError(f"{adapter}: the store was refused")
        acked = time.perf_counter()  # in L1; the write-through to L2 runs from here
        while (stored := stored_chunks(kind, root, settings)) < chunks:
            if time.perf_counter() - began > 600:
                raise RuntimeError(f"{adapter}: {stored}/{chunks} chunks stored")
            time.sleep(0.01)
        store_s = time.perf_counter() - began
        l1_to_l2_s = time.perf_counter() - acked
        sums = d.checksums(0)
        d.close()
        stop_server(settings)
        start_server(settings, env=env)
        admit_server(settings, disk)
        files = data_files(root, adapter)
        drop_caches()
        if kind == "raw_block":
            slot = raw_block_slot_bytes(kv_per_token)
            used = chunks * slot
            # the slots start after raw_block's 256 MiB metadata region (its meta_total_bytes)
            raw_read_s = timed(["dd", f"if={root / RAW_BLOCK_IMAGE}", "of=/dev/null", "bs=16M",
                                "iflag=direct", f"skip={RAW_BLOCK_META >> 24}",
                                f"count={-(-used // (16 << 20))}"], disk)
            drop_caches()
            raw_direct_s = raw_read_s  # one image: the dd above is already O_DIRECT
            drop_caches()
            raw_fio_s = raw_fio_read([root / RAW_BLOCK_IMAGE], disk, offset=RAW_BLOCK_META,
                                     size=used)
        else:
            raw_read_s = timed(["cat", *map(str, files)], disk)
            drop_caches()
            raw_direct_s = raw_direct_read(files, disk)
            drop_caches()
            raw_fio_s = raw_fio_read(files, disk)
        drop_caches()
        d = BenchDriver(settings.request_url, settings.http_url, MODEL,
                        num_tokens=tokens, shape_spec=spec, num_blocks=blocks,
                        transfer_mode=transfer_mode)
        trip = d.timed_restore(0, sums)
        own = adapter_counters(settings) if kind == "kvpersist" else {}
        # The same request again: LMCache loads it from L2 again (the objects a LOOKUP loaded
        # do not stay in L1 after the RETRIEVE), now from the page cache: the software path's
        # cost with the device out of the picture.
        again = d.timed_restore(0, sums)
        d.close()
    finally:
        stop_server(settings)
        adapter_config_with(None)
    file_bytes = (chunks * raw_block_slot_bytes(kv_per_token) if kind == "raw_block"
                  else sum(p.stat().st_size for p in files))
    shutil.rmtree(root, ignore_errors=True)  # the next adapter's round needs the space
    return {"adapter": adapter, "ok": trip.ok, "hit_chunks": trip.hit_chunks, "chunks": chunks,
            "payload_bytes": nbytes, "file_bytes": file_bytes, "store_s": store_s,
            "l1_to_l2_s": l1_to_l2_s, "raw_read_s": raw_read_s,
            "raw_direct_read_s": raw_direct_s, "raw_fio_read_s": raw_fio_s,
            "l2_to_l1_s": trip.lookup_s,
            "warm_l2_to_l1_s": again.lookup_s if again.ok else None,
            # kvpersist's own counters of that restore, summed over its reading threads
            "adapter_load_s": own.get("load_seconds"), "adapter_verify_s": own.get("verify_seconds"),
            "restore_s": trip.restore_s}


def fastest_raw_read_s(row: dict[str, Any]) -> float:
    """The round's fastest raw read of the adapter's bytes: cold ``cat``, parallel ``dd``, and
    ``fio`` where it ran."""
    return min(t for t in (row["raw_read_s"], row["raw_direct_read_s"],
                           row.get("raw_fio_read_s")) if t is not None)


def summarize(rows: list[dict[str, Any]], adapters: list[str]) -> list[dict[str, Any]]:
    """Per adapter: medians over rounds, and ratios against the same round's raw reads/write
    (``x raw read`` >= 1 means at least as fast as the faster raw read)."""
    out = []
    for adapter in adapters:
        mine = [r for r in rows if r["adapter"] == adapter]
        if not mine:
            continue

        def med(values: list[float]) -> float:
            return float(statistics.median(values))

        gb = mine[0]["payload_bytes"] / 1e9
        out.append({
            "adapter": adapter, "rounds": len(mine), "ok": all(r["ok"] for r in mine),
            "l2_to_l1_s": med([r["l2_to_l1_s"] for r in mine]),
            "l2_to_l1_gb_s": gb / med([r["l2_to_l1_s"] for r in mine]),
            "restore_s": med([r["restore_s"] for r in mine]),
            "store_s": med([r["store_s"] for r in mine]),
            "l1_to_l2_s": med([r["l1_to_l2_s"] for r in mine]),
            "raw_read_gb_s": gb / med([fastest_raw_read_s(r) for r in mine]),
            "x_raw_read": med([fastest_raw_read_s(r) / r["l2_to_l1_s"] for r in mine]),
            "fio_read_gb_s": (gb / med(fio) if (fio := [r["raw_fio_read_s"] for r in mine
                                                        if r.get("raw_fio_read_s")]) else None),
            "x_cat": med([r["raw_read_s"] / r["l2_to_l1_s"] for r in mine]),
            # the same LOOKUP again, from the page cache: the software path without the device
            "warm_l2_to_l1_s": med(warm) if (warm := [r["warm_l2_to_l1_s"] for r in mine
                                                      if r.get("warm_l2_to_l1_s")]) else None,
            "kvpersist_paired": paired_speedup(rows, adapter),
            "kvpersist_store_paired": paired_speedup(rows, adapter, "store_s"),
        })
    return out


def balanced_rounds(rows: list[dict[str, Any]]) -> set[int]:
    """The rounds in which each adapter ran first equally often: the order alternates by round,
    so an even count of them.  The adapter that ran first in a round was measured about 5 %
    slower at storing on the VM disk (docs/benchmarks.md), so an odd count of rounds would tilt
    a paired ratio towards whichever adapter ran second twice."""
    rounds = sorted({int(r["round"]) for r in rows if r.get("round") is not None})
    return set(rounds[:len(rounds) - len(rounds) % 2])


def paired_speedup(rows: list[dict[str, Any]], peer: str,
                   field: str = "l2_to_l1_s") -> float | None:
    """Median over order-balanced rounds (:func:`balanced_rounds`) of ``peer``'s ``field``
    time / kvpersist's in the same round (>= 1: kvpersist at least as fast).  Pairs within a
    round share the machine's state of the moment, so this ratio is steadier than the ratio of
    two medians on a noisy machine; a single round is its own pair."""
    use = balanced_rounds(rows) or {r.get("round") for r in rows}
    ours = {r.get("round"): r[field] for r in rows if r["adapter"] == "kvpersist"}
    ratios = [r[field] / ours[r.get("round")] for r in rows
              if r["adapter"] == peer and r.get("round") in ours and r.get("round") in use]
    return float(statistics.median(ratios)) if ratios and peer != "kvpersist" else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="a directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--kv-per-token", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1-gb", type=float, default=2.0)
    parser.add_argument("--adapters", default=",".join(ADAPTERS))
    parser.add_argument("--transfer-mode", default="lmcache_driven",
                        choices=("engine_driven", "lmcache_driven"),
                        help="how L1 reaches the client (lmcache_driven: shared memory, the CPU "
                        "default; engine_driven: pickled over ZMQ, which cannot carry 2 GiB "
                        "within the bench client's timeout)")
    parser.add_argument("--slow-disk-mb-s", type=float,
                        help="run on a loop-device ext4 whose reads are throttled to this rate "
                        "for the server and cat (a disk-bound comparison on a machine whose disk "
                        "is backed by the host's RAM)")
    parser.add_argument("--ram-device-mb", type=int,
                        help="run on an ext4 loop device of this size over a file in /dev/shm, "
                        "unthrottled: the disk is not the limit")
    parser.add_argument("--json", help="write the summary and the per-round results here")
    parser.add_argument("--plot", help="write a bar chart of L2->L1 GB/s per adapter (PNG) here")
    args = parser.parse_args()
    base = Path(args.root or tempfile.mkdtemp(prefix="kvp-restore-"))
    adapters = args.adapters.split(",")
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        disk = None
        if args.slow_disk_mb_s:
            size_mb = (len(adapters) + 2) * args.tokens * args.kv_per_token // 2**20 + 256
            disk = stack.enter_context(slow_disk(base, size_mb=size_mb,
                                                 read_bytes_per_s=int(args.slow_disk_mb_s * 2**20)))
            base = disk.mount
        elif args.ram_device_mb:
            ram = Path(tempfile.mkdtemp(prefix="kvp-ramdev-", dir="/dev/shm"))
            stack.callback(shutil.rmtree, ram, True)
            disk = stack.enter_context(slow_disk(ram, size_mb=args.ram_device_mb,
                                                 read_bytes_per_s=0))
            base = disk.mount
        for n in range(args.rounds):
            for adapter in adapters if n % 2 == 0 else adapters[::-1]:
                row = {"round": n, **one_round(adapter, base / adapter, args.tokens,
                                               args.kv_per_token, args.l1_gb,
                                               args.transfer_mode, disk)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    gb = args.tokens // 256 * 256 * args.kv_per_token / 1e9
    device = ("RAM loop device" if args.ram_device_mb else
              f"loop device read at {args.slow_disk_mb_s:g} MB/s" if args.slow_disk_mb_s
              else "VM disk")
    summary = summarize(rows, adapters)
    print(f"\n{device}: {args.tokens} tokens x {args.kv_per_token} B = {gb:.2f} GB, "
          f"{args.transfer_mode}, median of {args.rounds} rounds; ratios against the same "
          "round's fastest raw read (cold cat, 8 parallel O_DIRECT dd, fio O_DIRECT at queue depth 32)")
    print(f"{'adapter':<20} {'ok':>4} {'L2->L1 s':>9} {'GB/s':>6} {'raw GB/s':>9} "
          f"{'x raw read':>10} {'restore s':>10} {'store s':>8} {'L1->L2 s':>9} "
          f"{'warm s':>10}")
    for row in summary:
        print(f"{row['adapter']:<20} {row['ok']!s:>4} {row['l2_to_l1_s']:>9.2f} "
              f"{row['l2_to_l1_gb_s']:>6.2f} {row['raw_read_gb_s']:>9.2f} "
              f"{row['x_raw_read']:>10.2f} {row['restore_s']:>10.2f} {row['store_s']:>8.2f} "
              f"{row['l1_to_l2_s']:>9.2f} "
              f"{'-' if row['warm_l2_to_l1_s'] is None else format(row['warm_l2_to_l1_s'], '.2f'):>10}")
    print("(x raw read: the fastest raw read's time / L2->L1 time, so >= 1 is at least as fast; "
          "store: client STORE until every file is on disk; L1->L2: from the STORE's "
          "acknowledgement to the last file (the store against a raw write of the same bytes is "
          "bench_read_path.py's); warm: the same LOOKUP again, which reloads from L2 through the page "
          "cache)")
    if args.rounds % 2 and args.rounds > 1 and len(adapters) > 1:
        print(f"(paired ratios leave out round {args.rounds - 1}: the order alternates by round "
              "and the first adapter of a round is measured slower; an even --rounds uses all)")
    for row in summary:
        if row["kvpersist_paired"] is not None:
            print(f"kvpersist against {row['adapter']}, paired by round (median of "
                  f"{row['adapter']}'s time / kvpersist's in the same round): L2->L1 "
                  f"{row['kvpersist_paired']:.2f}x, store {row['kvpersist_store_paired']:.2f}x")
    by_name = {row["adapter"]: row for row in summary}
    for verified in ("kvpersist", "kvpersist-buffered"):
        if verified in by_name and f"{verified}-noverify" in by_name:
            share = 1 - (by_name[f"{verified}-noverify"]["l2_to_l1_s"]
                         / by_name[verified]["l2_to_l1_s"])
            print(f"verification's share of the L2->L1 time: {100 * share:.1f} % ({verified} "
                  f"against {verified}-noverify)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": device, "tokens": args.tokens, "kv_per_token": args.kv_per_token,
             "gb": gb, "transfer_mode": args.transfer_mode, "summary": summary,
             "rounds": rows}, indent=2) + "\n")
    if args.plot:
        bar_plot(Path(args.plot), f"L2->L1 after a restart, {gb:.2f} GB, {device}, cold cache",
                 "GB/s", {"L2->L1": {r["adapter"]: r["l2_to_l1_gb_s"] for r in summary},
                          "raw read (faster)": {r["adapter"]: r["raw_read_gb_s"]
                                                for r in summary}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
