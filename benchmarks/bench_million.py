"""Benchmark (on demand, never in CI): restores up to a million tokens through real vLLM (CPU).

A cold prefill of 1M tokens takes hours here, so the prompt's KV is written into L2 by the
synthetic-KV writer (:mod:`kvpersist.testing.kv_writer`) through the real LMCache server and
kvpersist's adapter, under exactly the keys vLLM's connector looks up.  Then, for each length,
both processes are restarted, the page cache is dropped, the same files are read raw (cold,
page cache dropped again), and the prompt's first ``length`` tokens plus a short suffix are
sent through ``kvp-vllm``: every full chunk must come from L2 (``cached_tokens``).  The answer
is not compared with a cold run: the KV is synthetic (the writer's CI test proves its keys and
layout on a real prefix, bit-identical).

    .venv/bin/python benchmarks/bench_million.py
        # 128k, 256k, 512k and 1M tokens at 4 KiB of KV per token (8 layers x 2 KV heads x 32,
        # float32: 4 GiB for 1M tokens) through an L1 of 1 GiB, a quarter of the 1M's KV
    .venv/bin/python benchmarks/bench_million.py --lengths 131072 --json OUT --plot OUT.png

What each row says, per length: TTFT (one generated token, so the request's latency); LMCache's
lookup (the scheduler's wait: it includes loading the first L1 window from L2); the L2 read
(kvpersist's adapter: read and verify, all windows); the suffix's compute (the same prompt sent
again, its prefix now in vLLM's own cache); the rest (L1 to the engine, scheduling); the raw
cold read of the same files; and each per chunk, which stays flat if nothing is quadratic.

With ``--devices 1,4`` (root; several drives, #50) the tier is N roots, each on its own ext4
loop device (an image on tmpfs) limited to ``--mb-s`` of reads on its own, all in one blkio
cgroup with the server, as from N drives (``testing.slow_disk.slow_disks``, as
``bench_roots.py`` does).  For each N the prompt is written afresh (writes unthrottled: they are
not what is measured) and every length restored; the raw cold read is then the faster of a
``cat`` per device at once and 8 O_DIRECT ``dd`` at a time over the same files, from inside the
cgroup.  The last table sets each N's TTFT beside the one-device TTFT of the same length.

    sudo .venv/bin/python benchmarks/bench_million.py --lengths 1048576 --devices 1,4 \
        --mb-s 50 --json OUT --plot OUT.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_restore import admit_server
from bench_roots import raw_parallel_reads

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, metric_sum
from kvpersist.demo.tiny_model import Geometry, build_tiny_model
from kvpersist.l2.layout import parse_name
from kvpersist.serving.launcher.vllm_client import http_json, served_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import (
    adapter_status,
    pins_for_model,
    server_env,
    server_settings_in,
    setting_overrides,
)
from kvpersist.testing.kv_writer import (
    CHUNK_TOKENS,
    EngineLayout,
    KvWriter,
    L2Pacer,
    namespace_record,
    seeded_fill,
)
from kvpersist.testing.plot import bar_plot, line_plot
from kvpersist.testing.slow_disk import SlowDisk, drop_caches, slow_disks, unavailable

GEOMETRIES = {
    # 8 layers x 2 KV heads x 32, float32: 4 KiB of KV per token, 4 GiB at 1M tokens.
    "4k": Geometry("kvpersist/tiny-llama-1m", 128, 8, 4, 2, 32, 1_100_000),
    # bench_long_chat.py's "mid": 8 layers x 4 KV heads x 64, float32: 16 KiB per token.
    "mid": Geometry("kvpersist/tiny-llama-mid-kv", 256, 8, 4, 4, 64, 147456),
}
LENGTHS = (131_072, 262_144, 524_288, 1_048_576)
SUFFIX = 100  # tokens after the last full chunk: computed by vLLM on every restore
LOOKUP = "vllm:lmcache_mp_lookup_duration_seconds_sum"
TIMEOUT = 7200.0


def complete(base_url: str, ids: list[int]) -> dict[str, Any]:
    """One token for the prompt ``ids`` (the completions API takes token IDs as they are)."""
    body = {"model": served_model(base_url), "prompt": ids, "max_tokens": 1,
            "temperature": 0.0}
    began = time.monotonic()
    reply = http_json(base_url + "/v1/completions", body, timeout=TIMEOUT)
    usage = reply["usage"]
    return {"seconds": time.monotonic() - began, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": int((usage.get("prompt_tokens_details") or {})
                                 .get("cached_tokens") or 0)}


def raw_cold_read(files: list[Path]) -> float:
    """Seconds to read ``files`` whole after dropping the page cache (no kvpersist, no LMCache)."""
    drop_caches()
    began = time.monotonic()
    for path in files:
        with path.open("rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    return time.monotonic() - began


def raw_parallel_cold_read(disks: list[SlowDisk], files: list[Path]) -> float:
    """Seconds of the faster cold raw parallel read of ``files`` from inside the devices'
    cgroup (``bench_roots.raw_parallel_reads``)."""
    by_device: dict[Path, list[Path]] = {d.mount: [] for d in disks}
    for path in files:
        by_device[next(m for m in by_device if path.is_relative_to(m))].append(path)
    return min(raw_parallel_reads(disks, by_device))


def files_by_hash(roots: tuple[Path, ...]) -> dict[bytes, Path]:
    """Chunk hash -> its L2 file under any of ``roots``, from the names alone (no file is
    read)."""
    return {parse_name(path.name).chunk_hash: path
            for root in roots for path in root.glob("*.kvp")}


@contextlib.contextmanager
def tier_on(work: Path, env: dict[str, str], devices: int,
            mb_s: float) -> Iterator[tuple[dict[str, str], list[SlowDisk]]]:
    """``env`` with its L2 tier moved onto ``devices`` fresh throttled devices (no devices: as
    it is), and those devices; undone on exit.  Each device holds its root's share of the
    budget and some slack (the images are sparse: only what is written takes memory)."""
    if not devices:
        yield env, []
        return
    size_mb = int(float(env["KVP_CACHE_BUDGET_GB"]) * 1024 / devices) + 512
    with slow_disks(work / f"devices-{devices}", devices, size_mb=size_mb,
                    read_bytes_per_s=int(mb_s * 2**20)) as disks:
        roots = [disk.mount / "kv" for disk in disks]
        for root in roots:
            root.mkdir(mode=0o700)
        yield ({**env, "KVP_CACHE_ROOT": str(roots[0]),
                "KVP_CACHE_EXTRA_ROOTS": ":".join(map(str, roots[1:]))}, disks)


def write_prompt(settings: Any, layout: EngineLayout, ids: list[int], l1_chunks: int) -> float:
    """Write every full chunk of ``ids`` in STOREs of a quarter of L1 at most, never more than
    half an L1 ahead of L2 (LMCache drops without an error what a full L1 cannot reserve).
    Seconds until the last chunk is on L2."""
    pacer = L2Pacer(settings.l2_roots, l1_chunks // 2)
    began = time.monotonic()
    per_store = max(1, min(32, l1_chunks // 4))
    with KvWriter(settings.request_url, layout, chunks_per_store=per_store) as writer:
        written = writer.write(ids, seeded_fill(1), between_stores=pacer)
    pacer.wait_for(written)
    return time.monotonic() - began


def write_tier(args: argparse.Namespace, work: Path, model: Path, pins: Path,
               env: dict[str, str], ids: list[int], tag: str) -> float:
    """vLLM started once with the serving recipe (it records the namespace the writer keys
    by), then every full chunk of ``ids`` written to L2: seconds of the write."""
    settings = load_settings(server_settings_in(env))
    start_server(settings)
    try:
        vllm = VllmProcess(model, pins, work / f"vllm-record{tag and '-' + tag}.log", env,
                           max_model_len=args.max_len, compile=True)
        try:
            vllm.start(timeout=1800)
            complete(vllm.base_url, ids[:64])
        finally:
            vllm.kill()
        layout = EngineLayout.from_record(namespace_record(settings.cache_root))
        l1_chunks = int(args.l1_gb * 2**30 // layout.chunk_bytes)
        write_s = write_prompt(settings, layout, ids, l1_chunks)
    finally:
        stop_server(settings)
    where = f" over {len(settings.l2_roots)} roots" if tag else ""
    print(f"wrote {len(ids) // CHUNK_TOKENS} chunks{where} in {write_s:.1f} s", flush=True)
    return write_s


def device_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length and device count (variants left out): TTFT beside the one-device TTFT of
    the same length (``x_one``: the one-device TTFT over this one; N would be perfect
    scaling) and the restore's time over the raw parallel cold read of the same files."""
    base = [r for r in rows if not r["server_settings"] and r["devices"]]
    one = {r["tokens"]: r for r in base if r["devices"] == 1}
    return [{"devices": r["devices"], "tokens": r["tokens"], "ttft_s": r["ttft_s"],
             "x_one": round(one[r["tokens"]]["ttft_s"] / r["ttft_s"], 2)
             if r["tokens"] in one else None,
             "restore_over_raw": r["restore_over_raw"]} for r in base]


def restore(args: argparse.Namespace, work: Path, model: Path, pins: Path, env: dict[str, str],
            ids: list[int], length: int, disks: list[SlowDisk]) -> dict[str, Any]:
    """Both processes restarted, page cache dropped: the prompt of ``length`` full-chunk tokens
    plus :data:`SUFFIX`, restored and timed, beside a raw cold read of the same files (in
    parallel over ``disks`` when the tier is on throttled devices, the server admitted to
    their cgroup)."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    settings = load_settings(server_settings_in(env))
    hashes = TokenHasher(CHUNK_TOKENS, "blake3").compute_chunk_hashes(ids[:length])
    by_hash = files_by_hash(settings.l2_roots)
    files = [by_hash[h] for h in hashes]
    raw_s = raw_parallel_cold_read(disks, files) if disks else raw_cold_read(files)
    start_server(settings)
    if disks:
        admit_server(settings, disks[0])
    vllm = VllmProcess(model, pins, work / f"vllm-{length}-{len(args.done)}.log", env,
                       max_model_len=args.max_len, compile=True)
    try:
        vllm.start(timeout=1800)
        before, status_before = vllm.metrics(), adapter_status(settings)
        drop_caches()
        prompt = ids[:length + SUFFIX]
        warm = complete(vllm.base_url, prompt)
        after, status_after = vllm.metrics(), adapter_status(settings)
        again = complete(vllm.base_url, prompt)  # the prefix in vLLM's own cache now
    finally:
        vllm.kill()
        stop_server(settings)
    chunks = len(hashes)
    lookup = metric_sum(after, LOOKUP) - metric_sum(before, LOOKUP)
    l2_read = status_after["load_seconds"] - status_before["load_seconds"]
    ttft, suffix = warm["seconds"], again["seconds"]
    row = {"tokens": length + SUFFIX, "chunks": chunks, "devices": len(disks),
           "server_settings": {k: v for k, v in env.items() if k in args.varied},
           "kv_gib": round(chunks * CHUNK_TOKENS * args.geometry.kv_bytes_per_token / 2**30, 3),
           "cached_tokens": warm["cached_tokens"], "full_chunk_tokens": chunks * CHUNK_TOKENS,
           "ttft_s": round(ttft, 2), "lookup_s": round(lookup, 2), "l2_read_s": round(l2_read, 2),
           "suffix_s": round(suffix, 2), "rest_s": round(ttft - lookup - suffix, 2),
           "raw_cold_read_s": round(raw_s, 2),
           "restore_over_raw": round((ttft - suffix) / raw_s, 2) if raw_s else None}
    row["ms_per_chunk"] = {k: round(1000 * float(row[k]) / chunks, 3)
                           for k in ("ttft_s", "lookup_s", "l2_read_s", "rest_s",
                                     "raw_cold_read_s")}
    print(json.dumps(row), flush=True)
    args.done.append(row)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="comma-separated prompt lengths in full-chunk tokens (each a "
                        f"multiple of {CHUNK_TOKENS}); default %(default)s")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="4k",
                        help="the model's KV geometry (default %(default)s: 4 KiB per token)")
    parser.add_argument("--l1-gb", type=float, default=1.0,
                        help="the server's L1 in GiB (default 1: a quarter of 1M tokens' KV)")
    parser.add_argument("--also-restore-longest-with", action="append", default=[],
                        type=setting_overrides, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="after the lengths, restore the longest again with these server "
                        "settings (repeatable): variants side by side on one written prompt")
    parser.add_argument("--devices", default="",
                        help="comma-separated device counts (e.g. 1,4; needs root): the tier "
                        "on that many throttled loop devices, one root each, every length "
                        "restored per count; default: one root on the work directory's disk")
    parser.add_argument("--mb-s", type=float, default=50.0,
                        help="with --devices: each device's read limit in MiB/s (default 50: "
                        "four stay well under this machine's unthrottled restore rate)")
    parser.add_argument("--work", help="work directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="write TTFT against length here (PNG); "
                        "with --devices, the longest length's TTFT breakdown per device count")
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    args.geometry = GEOMETRIES[args.geometry]
    if lengths[-1] + SUFFIX + 64 > args.geometry.max_pos:
        parser.error(f"this geometry's model takes at most {args.geometry.max_pos} tokens")
    if any(n % CHUNK_TOKENS for n in lengths):
        parser.error(f"every length must be a multiple of {CHUNK_TOKENS}")
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-million-"))
    args.max_len = lengths[-1] + SUFFIX + 64
    model = build_tiny_model(work / "models", args.geometry)
    pins = pins_for_model(model, work / "pins.env", max_model_len=args.max_len)
    kv_gib = lengths[-1] * args.geometry.kv_bytes_per_token / 2**30
    env = server_env(work / "cache", KVP_L1_SIZE_GB=f"{args.l1_gb:g}",
                     KVP_CACHE_BUDGET_GB=str(int(kv_gib) + 2))
    # vLLM's KV space: the longest prompt's KV and a tenth more (its own blocks' overhead).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.max_len * args.geometry.kv_bytes_per_token
                                            * 1.1 / 2**30) + 1)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    ids = [rng.randrange(16, vocab) for _ in range(lengths[-1] + SUFFIX)]

    counts = [int(c) for c in args.devices.split(",")] if args.devices else [0]
    if args.devices and (why := unavailable()) is not None:
        print(f"bench_million: cannot make throttled devices here: {why}", file=sys.stderr)
        return 2
    variants: list[dict[str, str]] = args.also_restore_longest_with
    args.varied = {k for v in variants for k in v}
    args.done = []
    rows: list[dict[str, Any]] = []
    write_s: dict[int, float] = {}
    for count in counts:
        with tier_on(work, env, count, args.mb_s) as (tier_env, disks):
            write_s[count] = write_tier(args, work, model, pins, tier_env, ids[:lengths[-1]],
                                        f"{count}-devices" if count else "")
            rows += [restore(args, work, model, pins, tier_env, ids, n, disks) for n in lengths]
            rows += [restore(args, work, model, pins, {**tier_env, **v}, ids, lengths[-1], disks)
                     for v in variants]
    print(f"\n{'devices':>7} {'tokens':>9} {'KV GiB':>7} {'TTFT s':>7} {'lookup':>7} {'L2 read':>8} "
          f"{'suffix':>7} {'rest':>6} {'raw read':>9} {'x raw':>6} {'ms/chunk':>9} {'cached':>9}")
    for r in rows:
        if r["server_settings"]:
            print(f"  with {r['server_settings']}:")
        print(f"{r['devices'] or '-':>7} {r['tokens']:>9} {r['kv_gib']:>7} {r['ttft_s']:>7} "
              f"{r['lookup_s']:>7} {r['l2_read_s']:>8} {r['suffix_s']:>7} {r['rest_s']:>6} "
              f"{r['raw_cold_read_s']:>9} {r['restore_over_raw']!s:>6} "
              f"{r['ms_per_chunk']['ttft_s']:>9} {r['cached_tokens']:>9}")
    comparison = device_comparison(rows) if args.devices else []
    if comparison:
        print(f"\neach device {args.mb_s:g} MiB/s of reads; x one: the one-device TTFT of the "
              "same length over this TTFT (N is perfect scaling); x raw: (TTFT - suffix) over "
              "the raw parallel cold read of the same files")
        for c in comparison:
            print(f"{c['devices']:>2} devices, {c['tokens']:>9} tokens: TTFT {c['ttft_s']} s, "
                  f"x one {c['x_one']}, x raw {c['restore_over_raw']}")
    result = {"geometry": args.geometry._asdict(),
              "kv_bytes_per_token": args.geometry.kv_bytes_per_token,
              "l1_gb": args.l1_gb,
              "write_s": round(write_s[0], 1) if counts == [0]
              else {str(n): round(t, 1) for n, t in write_s.items()},
              "rows": rows}
    if args.devices:
        result |= {"mb_s_per_device": args.mb_s, "by_devices": comparison}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot and args.devices:
        longest = [r for r in rows if r["tokens"] == lengths[-1] + SUFFIX
                   and not r["server_settings"]]
        bar_plot(args.plot, f"{lengths[-1]:,} tokens restored through vLLM (CPU) from N "
                 f"devices of {args.mb_s:g} MiB/s, L1 {args.l1_gb:g} GiB",
                 "seconds", {f"{r['devices']} device{'s' * (r['devices'] > 1)}": {
                     "TTFT": r["ttft_s"], "raw parallel cold read": r["raw_cold_read_s"],
                     "lookup (first L1 window)": r["lookup_s"],
                     "suffix compute": r["suffix_s"],
                     # rest = TTFT - lookup - suffix: below 0 only for a restore of a few
                     # chunks, where those two overlap by more than the rest takes
                     **({"rest": r["rest_s"]} if r["rest_s"] >= 0 else {})}
                     for r in longest})
    elif args.plot:
        base = rows[:len(lengths)]
        kib = args.geometry.kv_bytes_per_token // 1024
        line_plot(args.plot, f"Restore from L2 through vLLM (CPU), {kib} KiB KV/token, "
                  f"L1 {args.l1_gb:g} GiB",
                  "prompt tokens", "seconds", {
                      "TTFT (restored)": [(r["tokens"], r["ttft_s"]) for r in base],
                      "raw cold read of the files": [(r["tokens"], r["raw_cold_read_s"])
                                                     for r in base],
                      "lookup": [(r["tokens"], r["lookup_s"]) for r in base],
                      "suffix compute": [(r["tokens"], r["suffix_s"]) for r in base]})
    return 0 if all(r["cached_tokens"] == r["full_chunk_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
