"""The restore benchmark's results side by side: one Markdown table of ratios and one plot from
the JSON files ``bench_restore.py --json`` wrote (one per device and size).

    .venv/bin/python benchmarks/report_restore.py benchmarks/results/restore-256mib-vm-disk.json \\
        benchmarks/results/restore-256mib-ram-device.json ... --plot benchmarks/results/restore.png

Each file's rows are summarized again with ``bench_restore.summarize`` (medians over rounds,
ratios against the same round's fastest raw read), so a table never mixes rounds of different
runs.  Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_restore import summarize

from kvpersist.testing.plot import bar_plot


def label(result: dict[str, Any]) -> str:
    size = f"{result['gb'] * 1e9 / 2**30:.2f} GiB".replace(".00 GiB", " GiB") \
        if result["gb"] >= 1 else f"{result['gb'] * 1e9 / 2**20:.0f} MiB"
    return f"{size}, {result['device']}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| bytes, device | adapter | L2→L1 s | GB/s | fio GB/s | × raw read | × kvpersist "
             "| restore s | store s | warm L2→L1 s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        adapters = list(dict.fromkeys(r["adapter"] for r in result["rounds"]))
        summary = {row["adapter"]: row for row in summarize(result["rounds"], adapters)}
        ours = summary.get("kvpersist")
        first = True
        for adapter, row in summary.items():
            versus = "" if ours is None else f"{row['l2_to_l1_s'] / ours['l2_to_l1_s']:.2f}"
            warm = row.get("warm_l2_to_l1_s")
            fixed = "–" if warm is None else f"{warm:.2f}"
            name = f"**{adapter}**" if adapter == "kvpersist" else adapter
            fio = row.get("fio_read_gb_s")
            where = label(result) if first else ""
            lines.append(
                f"| {where} "
                f"| {name} | {row['l2_to_l1_s']:.2f} | {row['l2_to_l1_gb_s']:.2f} "
                f"| {'–' if fio is None else format(fio, '.2f')} | {row['x_raw_read']:.2f} "
                f"| {versus} | {row['restore_s']:.2f} "
                f"| {row['store_s']:.2f} | {fixed} |")
            first = False
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_restore.py --json files")
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) of L2->L1 GB/s here")
    args = parser.parse_args()
    results = [json.loads(path.read_text()) for path in args.results]
    print(table(results))
    print("\n(fio GB/s: one `fio` O_DIRECT pass over the adapter's files at queue depth 32, "
          "the device's limit for those files; × raw read: the fastest of a cold `cat`, 8 "
          "parallel O_DIRECT `dd` and that `fio` pass of the same files in the same round, over "
          "the L2→L1 time: ≥ 1 is at least as fast; × kvpersist: "
          "this adapter's L2→L1 time over kvpersist's, ≥ 1 means kvpersist is at least as fast)")
    if args.plot:
        groups: dict[str, dict[str, float]] = {}
        for result in results:
            adapters = list(dict.fromkeys(r["adapter"] for r in result["rounds"]))
            rows = summarize(result["rounds"], adapters)
            bars = {row["adapter"]: row["l2_to_l1_gb_s"] for row in rows}
            bars["raw read (median)"] = sorted(r["raw_read_gb_s"] for r in rows)[len(rows) // 2]
            fio = sorted(r["fio_read_gb_s"] for r in rows if r.get("fio_read_gb_s"))
            if fio:
                bars["fio (median)"] = fio[len(fio) // 2]
            name, run = label(result), 1
            while name in groups:  # two runs on the same device keep their own bars
                run += 1
                name = f"{label(result)}, run {run}"
            groups[name] = bars
        bar_plot(args.plot, "L2->L1 after a restart, page cache dropped (GB/s; higher is better)",
                 "GB/s", groups, size=(1300, 600))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
