"""The server's log relay: everything the server writes reaches the log, even when the server is
killed; a full disk drops output, never blocks the server; and a server whose log device is
stalled behind other reads still answers ``/status`` (the progress probe's source)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.serving import http
from kvpersist.serving.pidfile import check_pid_file
from kvpersist.serving.server import log_relay
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.serving.server.log_relay import Rotation, relay, start_log_relay
from kvpersist.testing import slow_disk
from kvpersist.testing.helpers import server_env

WRITER = ("import os, sys\n"
          "for i in range(int(sys.argv[1])): os.write(1, b'line %d\\n' % i)\n"
          "os.write(1, b'written\\n'); os.kill(os.getpid(), 9)\n")


def _open_log(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def test_every_line_arrives_when_the_writer_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    fd = _open_log(log)
    relay_proc = start_log_relay(fd)
    os.close(fd)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, "20000"], stdout=relay_proc.write_fd)
    relay_proc.release()
    assert os.getpgid(relay_proc.pid) != os.getpgid(writer.pid)  # a group kill spares it
    assert writer.wait(timeout=60) == -signal.SIGKILL
    assert relay_proc.drained(10)
    lines = log.read_text().splitlines()
    assert lines[:-1] == [f"line {i}" for i in range(20000)] and lines[-1] == "written"


def test_the_log_is_rotated_at_its_size_and_keeps_its_backups(tmp_path: Path) -> None:
    """A real relay process under a writer of 20,000 lines: no file grows past the bound, the
    oldest backups are dropped beyond the count, and the files that remain hold the newest
    lines in order, none lost between them."""
    log = tmp_path / "server.log"
    fd = _open_log(log)
    relay_proc = start_log_relay(fd, rotation=Rotation(log, 64 * 1024, 2))
    os.close(fd)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, "20000"], stdout=relay_proc.write_fd)
    relay_proc.release()
    writer.wait(timeout=60)
    assert relay_proc.drained(10)
    files = [log.with_name("server.log.2"), log.with_name("server.log.1"), log]
    assert all(f.stat().st_size <= 64 * 1024 + 16 for f in files)  # + the rest of a line
    assert not log.with_name("server.log.3").exists()
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    kept = [line for f in files for line in f.read_text().splitlines()]
    assert kept[-1] == "written" and len(kept) < 20000  # the oldest were rotated away
    first = int(kept[0].split()[1])
    assert kept[:-1] == [f"line {i}" for i in range(first, 20000)]


def test_a_full_disk_drops_output_and_never_blocks_the_writer(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    sink = os.open("/dev/full", os.O_WRONLY)
    payload = b"x" * (4 << 20)  # four times the largest pipe: a stuck relay would block us
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(read_fd)
        os.write(write_fd, payload)
        os._exit(0)
    os.close(write_fd)
    try:
        assert relay(read_fd, sink) == len(payload)
    finally:
        os.close(read_fd)
        os.close(sink)
    assert os.waitpid(pid, 0)[1] == 0


def test_lost_output_is_reported_once_writes_succeed_again(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # One read per message (SEQPACKET), and a sink whose first write fails as a full disk does.
    source, feeder = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for message in (b"lost\n", b"kept\n"):
        feeder.send(message)
    feeder.close()
    real_write_all, failures = log_relay._write_all, [OSError(28, "No space left on device")]

    def full_once(fd: int, data: bytes) -> str | None:
        return failures.pop().strerror if failures else real_write_all(fd, data)

    monkeypatch.setattr(log_relay, "_write_all", full_once)
    log = tmp_path / "server.log"
    sink = _open_log(log)
    try:
        assert relay(source.fileno(), sink) == 0  # the loss was reported, nothing is owed
    finally:
        os.close(sink)
        source.close()
    assert log.read_text().splitlines() == [
        "[kvpersist log relay] 5 bytes of server output were lost: No space left on device",
        "kept"]


@pytest.mark.serial  # drops the whole page cache and bounds /status answers to 2 s
@pytest.mark.integration
@pytest.mark.skipif(slow_disk.unavailable() is not None,
                    reason=f"no slow disk here: {slow_disk.unavailable()}")
def test_status_answers_while_the_log_device_is_stalled(tmp_path: Path) -> None:
    """The log's last page is evicted and the device is busy with a long read in the server's
    cgroup: appending the access line of a request must first read that page, behind 16 MiB at
    1 MiB/s.  A server writing its log itself stalled there (Python's logging lock held, the
    event loop with it); through the relay every ``/status`` answers at once."""
    with slow_disk.slow_disk(tmp_path, size_mb=128, read_bytes_per_s=1 << 20) as disk:
        big = disk.mount / "busy.bin"
        big.write_bytes(os.urandom(48 << 20))
        settings = load_settings(server_env(disk.mount / "cache"))
        reader = None
        try:
            start_server(settings)
            record = check_pid_file(settings.pid_file).record
            assert record is not None and record.log_relay_pid > 0
            disk.admit(record.pid)
            assert http.get_object(settings.http_url + "/status", timeout=5) is not None
            os.sync()
            slow_disk.drop_caches()
            reader = subprocess.Popen(
                ["sh", "-c", f'echo $$ > {disk.cgroup / "cgroup.procs"} && '
                             f'exec dd if={big} of=/dev/null bs=16M iflag=direct'],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # On purpose, the fault being provoked (the queued read shows in no counter): dd's
            # first 16 MiB read is queued, the device is busy for ~16 s.
            time.sleep(1.0)
            before = disk.read_bytes()
            answered = []
            for _ in range(4):
                began = time.monotonic()
                status = http.get_object(settings.http_url + "/status", timeout=2.0)
                answered.append((status is not None, round(time.monotonic() - began, 2)))
            assert all(ok for ok, _ in answered), answered
            assert reader.poll() is None  # the device really was busy all along
            assert disk.read_bytes() - before < 16 << 20
        finally:
            if reader is not None:
                reader.kill()
                reader.wait()
            stop_server(settings)
        log = settings.log_file.read_text()
        assert "GET /status" in log  # the access lines reached the log through the relay
