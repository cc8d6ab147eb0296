"""kvpersist.testing.processes with real processes: a killed process counts as gone only once
all its threads have exited (its listening socket then refuses), kill_server signals only the
process its pid file records, and a live process times out untouched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.serving.pidfile import PidRecord, process_start_ticks, wait_exited, write_pid_file
from kvpersist.testing.processes import kill_server

# A listener with busy threads: after SIGKILL its leader is a zombie before the others exit.
BUSY = ("import socket, sys, threading\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
        "for _ in range(4):\n"
        "    threading.Thread(target=lambda: [sum(range(10**5)) for _ in iter(int, 1)],\n"
        "                     daemon=True).start()\n"
        "print('up', flush=True)\n"
        "threading.Event().wait()\n")


def busy_listener(path: Path) -> tuple[subprocess.Popen[bytes], int]:
    child = subprocess.Popen([sys.executable, "-c", BUSY, str(path)], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().strip() == b"up"
    ticks = process_start_ticks(child.pid)
    assert ticks is not None
    return child, ticks


def refuses(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(path))
        except ConnectionRefusedError:
            return True
    return False


def test_a_killed_process_is_gone_only_when_its_socket_is_closed(tmp_path: Path) -> None:
    for i in range(3):  # the window between the zombie leader and the last thread is short
        path = tmp_path / f"s{i}.sock"
        child, ticks = busy_listener(path)
        os.kill(child.pid, 9)
        assert wait_exited(child.pid, 30.0, ticks=ticks)
        assert refuses(path), "gone, but its listening socket still accepts"
        assert not Path(f"/proc/{child.pid}").exists()  # our child: reaped


def test_kill_server_signals_the_recorded_process_and_waits(tmp_path: Path) -> None:
    settings = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path / "root")})
    settings.socket_dir.mkdir(parents=True, mode=0o700)  # the runtime dir holds the pid file
    child, ticks = busy_listener(tmp_path / "s.sock")
    try:
        write_pid_file(settings.pid_file, PidRecord(child.pid, ticks - 1, "lmcache server", 1, 2))
        with pytest.raises(AssertionError, match="another program"):  # a reused pid
            kill_server(settings)
        assert child.poll() is None, "a pid with another start time was signalled"
        write_pid_file(settings.pid_file, PidRecord(child.pid, ticks, "lmcache server", 1, 2))
        assert kill_server(settings) == child.pid
        assert refuses(tmp_path / "s.sock")
        assert settings.pid_file.exists()  # left stale, as a crash leaves it
    finally:
        if process_start_ticks(child.pid) == ticks:
            child.kill()
            child.wait()


def test_a_live_process_times_out_untouched(tmp_path: Path) -> None:
    child, ticks = busy_listener(tmp_path / "s.sock")
    try:
        assert not wait_exited(child.pid, 0.2, ticks=ticks)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
