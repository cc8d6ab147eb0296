"""``kvp-server run`` (systemd's ``Type=simple``): the process that was started becomes the server,
its pid file names it, and ``kvp-server stop`` ends it with SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.serving.pidfile import PidState, check_pid_file
from kvpersist.serving.server.lifecycle import is_healthy
from kvpersist.testing.helpers import server_env, tcp_listeners

pytestmark = pytest.mark.integration


def test_run_becomes_the_server_and_stop_ends_it(tmp_path: Path) -> None:
    env = {**os.environ, **server_env(tmp_path / "cache")}
    settings = load_settings(environ=env)
    log = tmp_path / "journal.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpersist.admin.cli", "server", "run"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(settings, timeout=1.0):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not healthy within 120 s"
            time.sleep(0.5)
        status = check_pid_file(settings.pid_file)
        assert status.state is PidState.RUNNING and status.record is not None
        assert status.record.pid == proc.pid  # the started process is the server
        assert tcp_listeners(proc.pid) == []
        assert "unix sockets" in log.read_text()
        stop = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "server", "stop"],
                              env=env, capture_output=True, text=True, timeout=90)
        assert stop.returncode == 0 and "stopped on SIGTERM" in stop.stdout, stop
        assert proc.wait(timeout=30) is not None
        assert not settings.pid_file.exists() and not settings.http_socket.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
