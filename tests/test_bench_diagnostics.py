"""``benchmarks/diagnostics/vllm_without_spin``: on a process's PYTHONPATH it takes away vLLM's
busy poll (``SpinCondition``'s ``busy_loop_s`` default, 1 s, becomes 0) and nothing else; off
it, vLLM is untouched.  The benchmark's claim about the spin's cost rests on both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DIAGNOSTIC = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "vllm_without_spin"
PROBE = ("from vllm.distributed.device_communicators.shm_broadcast import SpinCondition; "
         "print(SpinCondition.__init__.__defaults__)")


def _defaults_with(pythonpath: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("pythonpath", "expected"), [(None, "(1,)"), (str(DIAGNOSTIC), "(0,)")])
def test_the_busy_poll_is_gone_only_where_the_diagnostic_is_on_the_path(
        pythonpath: str | None, expected: str) -> None:
    pytest.importorskip("vllm")
    assert _defaults_with(pythonpath) == expected
