"""pidfile.wait_exited, the one wait for a process to end (server stop, log relay drain): a
child is reaped, a live process times out, a reused pid counts as exited."""

from __future__ import annotations

import subprocess
import sys

from kvpersist.serving.pidfile import process_start_ticks, wait_exited


def test_a_child_that_exits_is_reaped_and_reported() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert wait_exited(child.pid, 30.0)
    assert process_start_ticks(child.pid) is None  # reaped: no zombie left behind


def test_a_live_process_times_out_and_is_left_alone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not wait_exited(child.pid, 0.2)
        assert child.poll() is None  # never signalled
    finally:
        child.kill()
        child.wait()


def test_a_pid_now_held_by_another_process_counts_as_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = process_start_ticks(child.pid)
        assert ticks is not None
        assert wait_exited(child.pid, 5.0, ticks=ticks - 1)  # started at another time: not it
    finally:
        child.kill()
        child.wait()
