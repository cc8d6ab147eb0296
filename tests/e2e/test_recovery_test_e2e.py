"""``kvp-admin recovery-test`` on the CPU stack with the tiny model: both scenarios pass, with the
disk evidence of a real block device (a loop device holds the cache root); and against a stack that
is not running, or one without kvpersist, it says FAIL at once.

Scenario B's restore is made cold with ``--evict cache-files`` (the cache files' pages only, not
the whole page cache), so this test shares the machine with others; the device reads are the same
evidence.

Timings are never asserted here: the TTFT check is reported (the tiny model's prefill is too short
for a reliable difference on a loaded CI machine) and only its figures are checked for presence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import EAGER_ARGS
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import slow_disk
from kvpersist.testing.helpers import TINY_PINS, server_env

pytestmark = pytest.mark.e2e
TIMING_CHECKS = {"TTFT dropped"}


def recovery_test(env: dict[str, str], out: Path, *recipe: str,
                  timeout: float = 900) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvpersist.admin.cli", "recovery-test", "--out", str(out),
         "--evict", "cache-files", "--words", "150", "--vllm-timeout", "300",
         "--request-timeout", "120", "--", *recipe],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    results = json.loads((out / "results.json").read_text())
    return done.returncode, results, done.stdout + done.stderr


def tiny_recipe(model: Path) -> list[str]:
    """The tiny model's recipe, run eagerly like the other end-to-end tests' engines
    (:data:`kvpersist.demo.stack.EAGER_ARGS`): the recovery test compares its own runs only."""
    return [str(model), "--dtype", "float32", "--max-model-len", "2048",
            "--max-num-batched-tokens", "256", "--served-model-name", "tiny", *EAGER_ARGS]


@pytest.mark.skipif(slow_disk.unavailable() is not None, reason=str(slow_disk.unavailable()))
def test_both_scenarios_pass_with_disk_evidence(tiny_model: Path, tmp_path: Path) -> None:
    """Two L2 roots, each on its own loop device: the evidence names both devices (the first
    through KVP_CACHE_BLOCK_DEVICE, the second found from its root)."""
    with slow_disk.slow_disks(tmp_path, 2, size_mb=256, read_bytes_per_s=0) as disks:
        # The server is restarted through a command, as a unit's would be
        # (KVP_SERVER_RESTART='systemctl restart kvp-server'): kvp-server stop, then start.
        admin = f"{sys.executable} -m kvpersist.admin.cli server"
        roots = server_env(disks[0].mount / "cache",
                           KVP_CACHE_EXTRA_ROOTS=str(disks[1].mount / "cache"))
        env = {**roots, "KVP_IDENTITY_PINS": str(TINY_PINS),
               "VLLM_CPU_KVCACHE_SPACE": "1", "KVP_CACHE_BLOCK_DEVICE": disks[0].device,
               "KVP_SERVER_RESTART": f"sh -c 'touch {tmp_path}/restarted && {admin} stop && "
                                     f"{admin} start'"}
        settings = load_settings(roots)
        start_server(settings)
        try:
            code, results, output = recovery_test(env, tmp_path / "out", *tiny_recipe(tiny_model))
        finally:
            stop_server(settings)
    checks = results["checks"]
    assert isinstance(checks, list)
    assert (tmp_path / "restarted").exists()  # scenario B restarted through the command
    failed = [c for c in checks if c["status"] != "PASS" and c["name"] not in TIMING_CHECKS]
    assert failed == [], output[-3000:]
    names = {(c["scenario"], c["name"]) for c in checks}
    for scenario in ("A", "B"):
        for name in ("cached tokens reported", "hit from L2", "no new L2 data for the same chat",
                     "identical answer", "TTFT dropped"):
            assert (scenario, name) in names, (scenario, name)
    assert ("A", "L1 cleared") in names and ("B", "read from the cache device") in names
    device_check, = (c for c in checks if c["name"] == "read from the cache device")
    for disk in disks:  # each root's device counted and named
        assert f"{Path(disk.device).name}: " in device_check["detail"], device_check
    assert results["l2_roots"] == [str(d.mount / "cache") for d in disks]
    figures = results["figures"]
    assert isinstance(figures, dict)
    assert all(figures[k]["ttft_s"] > 0 for k in ("cold", "A", "B"))
    timing_ok = all(c["status"] == "PASS" for c in checks if c["name"] in TIMING_CHECKS)
    assert code == (0 if timing_ok else 1)
    listed = (tmp_path / "out" / "failures.txt").read_text()
    assert (listed == "") == timing_ok


def test_a_stack_that_is_not_running_fails_at_once(tmp_path: Path) -> None:
    env = {**server_env(tmp_path / "cache"), "KVP_IDENTITY_PINS": str(TINY_PINS)}
    began = time.monotonic()
    code, results, _ = recovery_test(env, tmp_path / "out", "/models/none", timeout=120)
    assert code == 1 and results["verdict"] == "FAIL"
    assert "does not answer" in (tmp_path / "out" / "failures.txt").read_text()
    assert time.monotonic() - began < 60  # a bound against a hang, not a timing measurement


def test_a_server_without_kvpersist_fails_at_once(tmp_path: Path) -> None:
    env = {**server_env(tmp_path / "cache", KVP_L2_ADAPTER="fs"),
           "KVP_IDENTITY_PINS": str(TINY_PINS)}
    settings = load_settings(server_env(tmp_path / "cache", KVP_L2_ADAPTER="fs"))
    start_server(settings)
    try:
        code, results, _ = recovery_test(env, tmp_path / "out", "/models/none", timeout=120)
    finally:
        stop_server(settings)
    assert code == 1 and results["verdict"] == "FAIL"
    assert "without the kvpersist L2 adapter" in (tmp_path / "out" / "failures.txt").read_text()
