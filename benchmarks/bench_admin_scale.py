"""Benchmark (on demand, never in CI): kvp-admin at scale, against ``du -s`` on the same tree.

Generates N sparse cache files over several namespaces (plus temp and quarantine files), flat
(the default layout) or sharded under ``ab/cd/`` (``KVP_L2_SHARDED=true``), then times, as separate
processes taking turns, ``du -s ROOT``, ``kvp-admin report --json`` and ``kvp-admin cleanup``
(dry run with a target), ``--repeat`` times, and prints each ratio to ``du -s`` of the same round
and the median ratios.  The issue's target is 1.5x.

    .venv/bin/python benchmarks/bench_admin_scale.py [--files 1000000] [--layout flat|sharded]
        [--root DIR] [--keep] [--repeat 3] [--walker auto|c|python] [--drop-caches] [--apply]

``--drop-caches`` (root only) empties the page, dentry and inode caches before each timed command,
so every one of them starts cold, as after a reboot.  ``--apply`` then also times
``kvp-admin cleanup --apply`` down to the same target (it deletes the files it plans: a kept tree
is smaller afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import KeyFields, format_name, shard_dirs

CHUNK = 256 * 1024


def generate(root: Path, n: int, sharded: bool) -> None:
    (root / "quarantine").mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for i in range(n):
        ns = f"kvp-{i % 13:032x}"
        key = KeyFields(f"org/model-{i % 13}/{ns}", 0x01000100, 0,
                        (i * 2654435761 % 2**64).to_bytes(8, "big") * 4)
        where = root.joinpath(*shard_dirs(key.chunk_hash)) if sharded else root
        if sharded:
            where.mkdir(parents=True, exist_ok=True)
        path = where / format_name(key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, HEADER_SIZE + CHUNK)
        os.close(fd)
        mtime = 1_700_000_000 + i
        os.utime(path, (mtime, mtime))
        if i and i % 250_000 == 0:
            print(f"  generated {i} files ({time.monotonic() - began:.0f}s)", flush=True)
    for j in range(100):
        (root / f"org--t--x_01000100_0_{j:04x}.kvp.tmp.{j:04x}").write_bytes(b"")
        (root / "quarantine" / f"q{j}.kvp.payload-checksum.{j}").write_bytes(b"")


def timed(cmd: list[str], env: dict[str, str], cold: bool = False) -> tuple[float, str]:
    """Seconds ``cmd`` took and its stdout; ``cold`` drops the kernel's caches first."""
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    began = time.monotonic()
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return time.monotonic() - began, res.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--layout", choices=("flat", "sharded"), default="flat")
    parser.add_argument("--root", help="where to build the tree (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the tree (reused next time)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of du/report/cleanup")
    parser.add_argument("--drop-caches", action="store_true",
                        help="start every timed command with cold caches (needs root)")
    parser.add_argument("--apply", action="store_true",
                        help="finally time cleanup --apply (deletes files of the tree)")
    parser.add_argument("--walker", choices=("auto", "c", "python"), default="auto",
                        help="kvp-admin's inventory walker (KVP_WALKER)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvp-admin-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KVP_CACHE_ROOT=str(root), KVP_HTTP_PORT="9", KVP_WALKER=args.walker,
               KVP_CACHE_BUDGET_GB="1500")
    py = sys.executable
    active = "kvp-" + "0" * 31 + "1"
    try:
        if any(root.glob("*.kvp")) or any(root.glob("??/??/*.kvp")):
            args.layout = "flat" if any(root.glob("*.kvp")) else "sharded"
            print(f"reusing the {args.layout} tree in {root}")
        else:
            print(f"generating {args.files} sparse files ({args.layout}) in {root}")
            generate(root, args.files, args.layout == "sharded")
        subprocess.run(["du", "-s", str(root)], check=True, capture_output=True)  # warm caches
        ratios: dict[str, list[float]] = {"report": [], "cleanup": []}
        for rnd in range(1, args.repeat + 1):
            du_s, _ = timed(["du", "-s", str(root)], env, args.drop_caches)
            report_s, out = timed([py, "-m", "kvpersist.admin.cli", "report", "--json", "--active", active],
                                  env, args.drop_caches)
            data = json.loads(out)
            files = sum(r["files"] for r in data["namespaces"])
            plan_s, out = timed([py, "-m", "kvpersist.admin.cli", "cleanup", "--dry-run", "--active", active,
                                 "--target-gb", "100"], env, args.drop_caches)
            ratios["report"].append(report_s / du_s)
            ratios["cleanup"].append(plan_s / du_s)
            print(f"round {rnd}: du -s {du_s:.2f}s | report --json {report_s:.2f}s "
                  f"({report_s / du_s:.2f}x, {files} live files, scan {data['scan_seconds']:.2f}s) | "
                  f"cleanup dry run {plan_s:.2f}s ({plan_s / du_s:.2f}x)", flush=True)
        print(f"cleanup said: {out.splitlines()[0]}")
        print(f"median ratio to du -s ({args.layout}, {args.walker} walker"
              f"{', cold caches' if args.drop_caches else ''}): "
              f"report {statistics.median(ratios['report']):.2f}x, "
              f"cleanup dry run {statistics.median(ratios['cleanup']):.2f}x (target 1.5x)")
        if args.apply:
            apply_s, out = timed([py, "-m", "kvpersist.admin.cli", "cleanup", "--apply",
                                  "--active", active, "--target-gb", "100"], env)
            print(f"cleanup --apply: {apply_s:.1f}s: {out.splitlines()[-1]}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
