"""Benchmark (on demand, never in CI): kvp-admin at scale, against ``du -s`` on the same tree.

Generates N sparse cache files over several namespaces (plus temp and quarantine files), then in
one run times ``du -s ROOT``, ``kvp-admin report --json`` and ``kvp-admin cleanup --json``
(dry run), each as a separate process, and prints the ratios.

    .venv/bin/python benchmarks/bench_admin_scale.py [--files 1000000] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "implementation"))

from kvpersist.l2_format import HEADER_SIZE, KeyFields, format_name  # noqa: E402

CHUNK = 256 * 1024


def generate(root: Path, n: int) -> None:
    (root / "quarantine").mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for i in range(n):
        ns = f"kvp-{i % 13:032x}"
        key = KeyFields(f"org/model-{i % 13}/{ns}", 0x01000100, 0,
                        (i * 2654435761 % 2**64).to_bytes(8, "big") * 4)
        fd = os.open(root / format_name(key), os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, HEADER_SIZE + CHUNK)
        os.close(fd)
        mtime = 1_700_000_000 + i
        os.utime(root / format_name(key), (mtime, mtime))
        if i and i % 250_000 == 0:
            print(f"  generated {i} files ({time.monotonic() - began:.0f}s)", flush=True)
    for j in range(100):
        (root / f"org--t--x_01000100_0_{j:04x}.kvp.tmp.{j:04x}").write_bytes(b"")
        (root / "quarantine" / f"q{j}.kvp.payload-checksum.{j}").write_bytes(b"")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    began = time.monotonic()
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return time.monotonic() - began, res.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--root", help="where to build the tree (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the tree (reused next time)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvp-admin-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KVP_CACHE_ROOT=str(root), KVP_HTTP_PORT="9",
               KVP_CACHE_BUDGET_GB="1500", PYTHONPATH=str(REPO / "implementation"))
    py = sys.executable
    try:
        if any(root.glob("*.kvp")):
            print(f"reusing the tree in {root}")
        else:
            print(f"generating {args.files} sparse files in {root}")
            generate(root, args.files)
        subprocess.run(["du", "-s", str(root)], check=True, capture_output=True)  # warm caches
        du_s, _ = timed(["du", "-s", str(root)], env)
        report_s, out = timed([py, "-m", "kvpersist.cli", "report", "--json",
                               "--active", "kvp-" + "0" * 31 + "1"], env)
        files = sum(r["files"] for r in json.loads(out)["namespaces"])
        plan_s, out = timed([py, "-m", "kvpersist.cli", "cleanup",
                             "--active", "kvp-" + "0" * 31 + "1", "--target-gb", "100"], env)
        planned = out.splitlines()[0]
        print(f"du -s                      : {du_s:.2f}s")
        print(f"kvp-admin report --json    : {report_s:.2f}s ({report_s / du_s:.2f}x du), "
              f"{files} live files")
        print(f"kvp-admin cleanup (dry run): {plan_s:.2f}s ({plan_s / du_s:.2f}x du): {planned}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
