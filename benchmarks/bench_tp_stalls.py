"""Diagnostic (on demand, never in CI): how often a TP=2 restore on this host stalls because
vLLM's pinned, busy-polling workers starve everything else, with and without the server's
``KVP_SERVER_NICE``, side by side in one run.

Per setting, one server and ``--rounds`` vLLM instances in turn (each a fresh start, like a
restart): round 0 computes and stores a chat, every later round restarts the server and vLLM
and restores the same chat from L2.  Per round it records whether a worker or the scheduler
logged LMCache's ``server is unhealthy``, whether the connector bypassed the lookup, the
restored tokens, and the longest oversleep of a canary: a separate ordinary (SCHED_OTHER)
process in its own session that sleeps 50 ms in a loop.  A canary that wakes seconds late means
the host gave ordinary processes no CPU for that long.

    sudo .venv/bin/python benchmarks/bench_tp_stalls.py --rounds 8 \\
        --json benchmarks/results/tp-stalls.json

Seen on the 2-core CI machine (2026-12-01): without a nice value about one restore in three
stalled for 3-14 s (canary gaps of the same length, every heartbeat timed out within 80 ms of
the others); at nice -10 fewer, but not none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.environment import apply_to_current_process
from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.demo.tiny_model import build_tiny_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import server_env, wait_for_l2_files, write_pins

CANARY = """
import sys, time
worst, last = 0.0, time.monotonic()
while True:
    time.sleep(0.05)
    now = time.monotonic()
    worst = max(worst, now - last - 0.05)
    last = now
    with open(sys.argv[1], "w") as f:
        f.write(f"{worst:.3f}")
"""
UNHEALTHY = "LMCache server is unhealthy"
BYPASS = re.compile(r"bypasses the KV cache \(([^;)]*)")


def run_setting(model: Path, tmp: Path, nice: int, rounds: int) -> list[dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = server_env(tmp / "cache", KVP_SERVER_NICE=str(nice))
    settings = load_settings(env)
    pins = write_pins(tmp / "pins.env", tensor_parallel_size="2")
    vllm_env = {**env, "KVP_MP_TRANSFER_MODE": "lmcache_driven",
                "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    extra = ["--no-enable-prefix-caching", "--tensor-parallel-size", "2"]
    messages = long_conversation(1300, "tp stalls")
    out: list[dict[str, Any]] = []
    try:
        for i in range(rounds):
            stop_server(settings)
            start_server(settings)
            log = tmp / f"vllm-{i}.log"
            vllm = VllmProcess(model, pins, log, vllm_env, extra_args=extra, compile=True)
            gap_file = tmp / f"canary-{i}"
            canary = subprocess.Popen([sys.executable, "-c", CANARY, str(gap_file)],
                                      start_new_session=True)
            try:
                vllm.start()
                result = chat(vllm.base_url, messages, timeout=600)
                if i == 0:
                    wait_for_l2_files(settings.cache_root, 10, timeout=120)
            finally:
                canary.kill()
                vllm.kill()
            text = log.read_text(errors="replace")
            bypass = BYPASS.search(text)
            row = {"round": i, "restore": i > 0, "cached_tokens": result.cached_tokens,
                   "unhealthy": UNHEALTHY in text, "bypass": bypass.group(1) if bypass else None,
                   "canary_worst_gap_s": float(gap_file.read_text() or 0)}
            print(f"nice {nice:>3} round {i}: {row}", flush=True)
            out.append(row)
    finally:
        stop_server(settings)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="vLLM starts per setting")
    parser.add_argument("--nice", type=int, nargs="+", default=[0, -10],
                        help="KVP_SERVER_NICE values to compare (negative ones need root)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    apply_to_current_process()
    with tempfile.TemporaryDirectory(prefix="kvp-tp-stalls-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_tiny_model(tmp / "models")
        results = {str(n): run_setting(model, tmp / f"nice{n}", n, args.rounds)
                   for n in args.nice}
    for nice, rows in results.items():
        restores = [r for r in rows if r["restore"]]
        stalled = sum(r["unhealthy"] for r in restores)
        missed = sum(r["cached_tokens"] == 0 for r in restores)
        worst = max(r["canary_worst_gap_s"] for r in rows)
        print(f"KVP_SERVER_NICE={nice}: {stalled}/{len(restores)} restores saw a missed "
              f"heartbeat, {missed} got 0 hits; longest canary oversleep {worst:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"host_cpus": os.cpu_count(), "when": time.time(),
                                         "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
