"""``kill -USR1`` of a running server writes every thread's Python stack to its log, and the
server goes on answering (docs/operations.md, "Troubleshooting")."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kvpersist.config.server import load_settings
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import server_env
from kvpersist.testing.processes import server_pid


def test_sigusr1_dumps_every_thread_s_stack_and_the_server_goes_on(tmp_path: Path) -> None:
    settings = load_settings(server_env(tmp_path / "cache"))
    start_server(settings)
    try:
        pid = server_pid(settings)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        text = ""
        while "Current thread" not in text:  # faulthandler's header of the signalled thread
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.2)
            text = settings.log_file.read_text(errors="replace")
        assert text.count("(most recent call first)") >= 5, text[-4000:]  # LMCache's threads
        assert "kvpersist/l2/" in text  # the adapter's own threads are among them
        assert server_pid(settings) == pid
        assert http.get_object(settings.http_url + "/status", timeout=10) is not None
    finally:
        stop_server(settings)
