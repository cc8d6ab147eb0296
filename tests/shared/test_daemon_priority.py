"""The shared-tree tests raise the GlusterFS daemons' CPU priority to the cache server's
(kvpersist.testing.glusterfs.raise_daemon_priority): every thread of each named process and its
session's autogroup.  Shown on a stand-in daemon (a copy of ``sleep`` under a name of its own,
in its own session), so that no real GlusterFS process is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvpersist.testing.glusterfs import raise_daemon_priority

NAME = "kvpfakegluster"  # a process's comm is at most 15 characters


def test_every_thread_and_the_session_s_autogroup_get_the_priority(tmp_path: Path) -> None:
    binary = tmp_path / NAME
    shutil.copy(shutil.which("sleep") or "/bin/sleep", binary)
    daemon = subprocess.Popen([str(binary), "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{daemon.pid}/comm").read_text().strip() != NAME:
            assert time.monotonic() < deadline, "the stand-in daemon never showed its name"
            time.sleep(0.05)
        # lowering a priority needs no privilege; raising it (the real use) needs root
        pids = raise_daemon_priority(7, names=(NAME,))
        assert pids == [daemon.pid]
        for task in Path(f"/proc/{daemon.pid}/task").iterdir():
            assert os.getpriority(os.PRIO_PROCESS, int(task.name)) == 7
        autogroup = Path(f"/proc/{daemon.pid}/autogroup")
        if not autogroup.exists():
            pytest.skip("this kernel has no autogroup; the thread priority was checked")
        assert autogroup.read_text().split()[-1] == "7", autogroup.read_text()
        assert raise_daemon_priority(7, names=("no-such-daemon",)) == []
    finally:
        daemon.kill()
        daemon.wait()
