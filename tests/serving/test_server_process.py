"""Naming the process behind a server's socket, and knowing when that very process is gone,
with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvpersist.serving.connector.worker.server_process import ServerProcess, listener_of, process
from kvpersist.testing.helpers import wait_until

LISTEN = ("import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
          "s.listen(); print('up', flush=True); time.sleep(60)")


def proc_state(pid: int) -> str:
    """The kernel's state letter for ``pid`` (``/proc/<pid>/stat`` field 3; "Z": a zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def unix_url(path: Path) -> str:
    return "http+unix://" + str(path).replace("/", "%2F") + "/status"


def test_listener_of_names_the_process_that_listens(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    child = subprocess.Popen([sys.executable, "-c", LISTEN, str(path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"up"
        named = listener_of(unix_url(path))
        assert named is not None and named.pid == child.pid and not named.gone()
    finally:
        child.kill()
        child.wait()
    assert named.gone()
    assert listener_of(unix_url(path)) is None, "a socket file nobody listens on names no one"
    assert listener_of("http://127.0.0.1:9/status") is None, "TCP: the kernel does not say"


def test_a_zombie_is_gone_and_a_recycled_pid_is_another_process(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"])
    me = process(child.pid)
    assert me is not None and not me.gone()
    child.kill()
    # killed, not yet reaped: a zombie, whose memory is released
    wait_until(lambda: proc_state(child.pid) == "Z", timeout=30, interval=0.05)
    assert me.gone()
    child.wait()
    assert me.gone() and process(child.pid) is None
    alive = process(os.getpid())
    assert alive is not None and ServerProcess(alive.pid, alive.started + 1).gone(), \
        "the same pid with another start time is a later process"
