"""kill -9 the LMCache server at random moments during heavy L2 stores, restart, and check the
promises: no temp file remains, every file verifies, a retrieve never returns wrong bytes, the
accounting equals the disk.  Used by the CI test (a few cycles) and benchmarks/crash_cycles.py.
Each cycle checks the sequences written in that cycle and a sample of earlier ones.

The writer runs in a separate process (LMCache's bench client), so a dying server cannot wedge
the checker; the kill lands while the server's write-through to L2 is in progress.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..config.environment import process_env
from ..config.server import ServerSettings
from ..l2.files import verify_file
from ..serving.server.lifecycle import start_server, stop_server
from .helpers import adapter_status
from .lmcache_bench import BenchDriver
from .processes import kill_server

MODEL = "org/crash/kvp-" + "c" * 32
WRITER = r"""
import sys
from kvpersist.testing.lmcache_bench import BenchDriver
zmq, http, model, first, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
d = BenchDriver(zmq, http, model)
for seq in range(first, first + count):
    d.store(seq)
    print(seq, flush=True)
"""


@dataclass
class CycleReport:
    cycles: int = 0
    kills: int = 0
    files_checked: int = 0
    wrong_reads: int = 0
    bad_files: list[str] = field(default_factory=list)
    temp_left: int = 0
    temp_removed_at_start: int = 0
    accounting_mismatches: int = 0
    retrieved_chunks: int = 0
    missed_chunks: int = 0


def _wait_scan(s: ServerSettings, timeout: float = 120.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        status = adapter_status(s)
        if status["scan_done"]:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError("start-up scan did not finish")
        time.sleep(0.2)


def run_cycles(settings: ServerSettings, cycles: int, *, seqs_per_cycle: int = 12,
               seed: int = 1234, log: object = None) -> CycleReport:
    rng = random.Random(seed)
    report = CycleReport()
    zmq = settings.request_url
    stored_upto = 0
    start_server(settings)
    for cycle in range(cycles):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, zmq, settings.http_url, MODEL,
             str(stored_upto), str(seqs_per_cycle)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=process_env())
        # Kill once the writer has issued a random number of stores: L2 write-through is busy.
        kill_after = rng.randint(1, seqs_per_cycle)
        assert writer.stdout is not None
        deadline = time.monotonic() + 120
        issued = 0
        while issued < kill_after and time.monotonic() < deadline:
            line = writer.stdout.readline()
            if not line:
                break
            issued += 1
        time.sleep(rng.uniform(0.0, 0.05))  # a random moment within the stores, on purpose
        kill_server(settings)  # SIGKILL; returns once the server has exited
        report.kills += 1
        writer.kill()
        writer.wait(timeout=30)
        stored_upto += seqs_per_cycle

        start_server(settings)  # stale pid file replaced; scan removes temp files
        status = _wait_scan(settings)
        report.temp_removed_at_start += int(status["temp_removed"])  # type: ignore[call-overload]
        root = settings.cache_root
        report.temp_left += sum(1 for p in root.iterdir() if ".tmp." in p.name)
        disk = sum(p.stat().st_size for p in root.glob("*.kvp"))
        if status["used_bytes"] != disk:
            report.accounting_mismatches += 1
        for path in sorted(root.glob("*.kvp")):
            reason, _ = verify_file(path)
            report.files_checked += 1
            if reason is not None:
                report.bad_files.append(f"{path.name}: {reason}")
        checker = BenchDriver(zmq, settings.http_url, MODEL)
        earlier = range(stored_upto - seqs_per_cycle)
        sample = rng.sample(earlier, min(len(earlier), seqs_per_cycle))
        for seq in [*range(stored_upto - seqs_per_cycle, stored_upto), *sample]:
            expected = checker.checksums(seq)
            trip = checker.lookup_and_retrieve(seq, expected)
            report.retrieved_chunks += trip.hit_chunks
            report.missed_chunks += trip.total_chunks - trip.hit_chunks
            if trip.hit_chunks and not (trip.retrieved_ok and trip.checksums_match):
                report.wrong_reads += 1
        checker.close()  # the server stays up: the next cycle's writer uses it
        report.cycles += 1
        if callable(log):
            log(f"cycle {cycle + 1}/{cycles}: killed after {issued} stores; "
                f"{report.files_checked} files checked so far, wrong reads {report.wrong_reads}")
    stop_server(settings)
    return report
