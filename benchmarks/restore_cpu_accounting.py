"""Benchmark (on demand, never in CI): where the CPU goes while vLLM restores a long chat from
L2, process by process, on a chat ``bench_long_chat.py --work DIR`` stored before.

For each restore (both processes started afresh, the page cache dropped) it sends the chat, then
the same chat again with its prefix in vLLM's own cache (the suffix's compute and the answer),
and reads every process's CPU seconds (``/proc/<pid>/stat``) before and after each: the restore
alone is the first time minus the second, and the CPU columns say which processes held the two
cores meanwhile; then a cold raw read of the chat's files (the page cache dropped) gives the
ratio.  Variants alternate with the configured settings: a server setting restarts the server
with it, anything else goes to vLLM's environment alone.  ``diagnostics/vllm_without_spin`` on
vLLM's PYTHONPATH takes away vLLM's busy poll (a diagnostic, never the product's recipe): how
much of the restore's time on 2 cores is the CPU that poll holds.

    .venv/bin/python benchmarks/bench_long_chat.py --geometry mid --tokens 127500 --l1-gb 0.5 \
        --work /tmp/chat128
    .venv/bin/python benchmarks/restore_cpu_accounting.py --work /tmp/chat128/default \
        --rounds 3 --variant KVP_SERVER_NICE=-10
    .venv/bin/python benchmarks/restore_cpu_accounting.py --work /tmp/chat128/default \
        --rounds 3 --variant PYTHONPATH=$PWD/benchmarks/diagnostics/vllm_without_spin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_long_chat

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import l2_data_files, server_settings_in, setting_overrides
from kvpersist.testing.slow_disk import drop_caches

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[tuple[int, str], float]:
    """User + system CPU seconds of every process, by (pid, name)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(int(pid), name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def accounted(call: Callable[[], Any]) -> tuple[Any, float, dict[str, float]]:
    """``call()``'s result, its seconds, and the CPU seconds each process name spent meanwhile
    (at least 0.05 s)."""
    before, began = cpu_seconds(), time.monotonic()
    result = call()
    took, after = time.monotonic() - began, cpu_seconds()
    spent: dict[str, float] = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if delta >= 0.05:
            spent[key[1]] = round(spent.get(key[1], 0.0) + delta, 2)
    return result, took, dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True,
                        help="a bench_long_chat.py work directory holding a stored chat "
                        "(its 'default' subdirectory)")
    parser.add_argument("--geometry", choices=sorted(bench_long_chat.GEOMETRIES), default="mid")
    parser.add_argument("--tokens", type=int, default=127500)
    parser.add_argument("--l1-gb", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], type=setting_overrides,
                        metavar="KEY=VALUE[,KEY=VALUE]",
                        help="settings restored after the configured ones in each round: the "
                        "server's own go to the server, the others (PYTHONPATH=...) to vLLM alone")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    geometry = bench_long_chat.GEOMETRIES[args.geometry]
    setup = bench_long_chat.chat_setup(args.work, geometry, args.tokens, args.l1_gb)
    files = l2_data_files(load_settings(setup.server_vars).cache_root)
    rows = []
    for _ in range(args.rounds):
        for variant in [{}, *args.variant]:
            settings = load_settings({**setup.server_vars, **server_settings_in(variant)})
            start_server(settings)
            vllm = VllmProcess(setup.model, setup.pins, args.work / "vllm-cpu.log",
                               {**setup.vllm_env, **variant}, max_model_len=setup.max_len,
                               compile=True)
            try:
                vllm.start(timeout=1800)
                drop_caches()
                first, restored_s, restore_cpu = accounted(
                    lambda v=vllm: chat(v.base_url, setup.messages, timeout=7200))
                _, suffix_s, suffix_cpu = accounted(
                    lambda v=vllm: chat(v.base_url, setup.messages, timeout=7200))
            finally:
                vllm.kill()
                stop_server(settings)
            raw_s, _ = bench_long_chat.raw_cold_read(files)
            row = {"variant": variant, "restored_s": round(restored_s, 2),
                   "suffix_s": round(suffix_s, 2), "alone_s": round(restored_s - suffix_s, 2),
                   "raw_cold_read_s": round(raw_s, 2),
                   "alone_over_raw_read": round((restored_s - suffix_s) / raw_s, 2),
                   "cached_tokens": first.cached_tokens, "restore_cpu_s": restore_cpu,
                   "suffix_cpu_s": suffix_cpu}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
