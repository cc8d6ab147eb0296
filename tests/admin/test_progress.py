"""The progress line: a bar with a known total, a count without one, only ever on a terminal."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

from kvpersist.admin.progress import BAR_WIDTH, Progress, stderr_progress
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.store import KvFileStore


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_with_a_total() -> None:
    out = Terminal()
    bar = Progress("verify", 10, stream=out, min_interval=0)
    bar(5)
    line = out.getvalue()
    assert line.startswith("\rverify [" + "#" * (BAR_WIDTH // 2) + "." * (BAR_WIDTH // 2) + "]")
    assert " 50.0% 5/10 files" in line and "left" in line
    bar.close()
    assert out.getvalue().endswith("\r\x1b[K")


def test_count_without_a_total_and_throttling() -> None:
    out = Terminal()
    count = Progress("report: scanning", stream=out, min_interval=3600)
    count(10_000)
    count(20_000)  # within min_interval: not drawn
    assert out.getvalue().count("\r") == 1 and "report: scanning: 10,000 files (" in out.getvalue()
    bar = Progress("x", 3, stream=out, min_interval=3600)
    bar(1)
    bar(3)  # the last one is always drawn
    assert "100.0% 3/3" in out.getvalue()


def test_silent_when_not_a_terminal() -> None:
    assert stderr_progress("x") is None  # pytest captures stderr: not a tty


def test_kvp_admin_verify_draws_a_bar_on_a_terminal(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store = KvFileStore(root, capacity_bytes=1 << 30)
    store.open(background_scan=False)
    for i in range(3):
        store.put(KeyFields(f"o/m/kvp-{'a' * 32}", 0, 0, bytes([i]) * 8), b"\1" * 64)
    store.close()
    leader, follower = pty.openpty()
    env = dict(os.environ, KVP_CACHE_ROOT=str(root), PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "verify"], stdout=subprocess.PIPE,
                         stderr=follower, env=env, timeout=120)
    os.close(follower)
    drawn = os.read(leader, 65536).decode()
    os.close(leader)
    assert res.returncode == 0, drawn
    assert "verify [" + "#" * BAR_WIDTH + "] 100.0% 3/3 files" in drawn
    assert res.stdout.decode().startswith("verified 3 files")
