"""Benchmark-style reliability run (on demand): kill -9 the LMCache server at random moments
during heavy L2 stores, N cycles (default 50), and report wrong reads (must be 0), files
checked, temp files left (must be 0) and accounting mismatches (must be 0).

    .venv/bin/python benchmarks/crash_cycles.py [--cycles 50] [--root DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import free_port
from kvpersist.serving.server.lifecycle import stop_server
from kvpersist.testing.crash_cycles import run_cycles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--root", help="cache root (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvp-crash-")) / "cache"
    settings = load_settings({
        "KVP_CACHE_ROOT": str(root), "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": "1", "KVP_CACHE_BUDGET_GB": "8",
        "KVP_L2_ADAPTER": "kvpersist"})
    began = time.monotonic()
    try:
        report = run_cycles(settings, args.cycles, log=print)
    finally:
        stop_server(settings)
    print(f"\n{report.cycles} kill -9 cycles in {time.monotonic() - began:.0f}s")
    print(f"wrong reads            : {report.wrong_reads}")
    print(f"files verified         : {report.files_checked} (bad: {len(report.bad_files)})")
    print(f"temp files left        : {report.temp_left} "
          f"(removed by start-up scans: {report.temp_removed_at_start})")
    print(f"accounting mismatches  : {report.accounting_mismatches}")
    print(f"chunks retrieved/missed: {report.retrieved_chunks}/{report.missed_chunks}")
    for line in report.bad_files:
        print(f"  bad: {line}")
    ok = not (report.wrong_reads or report.bad_files or report.temp_left
              or report.accounting_mismatches)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
