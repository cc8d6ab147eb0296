"""``KVP_SERVER_NICE``: the server runs ahead of vLLM's spinning workers when asked, every thread
of it, and a priority it may not take stops it with a message instead of running without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.serving.cpu_priority import PriorityError, apply_nice
from kvpersist.serving.server import start_server, stop_server
from kvpersist.testing.helpers import server_env
from kvpersist.testing.processes import server_pid


def thread_nices(pid: int) -> set[int]:
    """The nice value of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found.add(int(fields[16]))
    return found


@pytest.mark.parametrize("raw", ["-21", "20", "high", ""])
def test_a_nice_value_outside_minus_20_to_19_is_refused_with_its_name(
        tmp_path: Path, raw: str) -> None:
    with pytest.raises(SettingsError, match="KVP_SERVER_NICE"):
        load_settings(server_env(tmp_path / "cache", KVP_SERVER_NICE=raw))


def test_zero_changes_nothing_and_out_of_range_is_refused() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    apply_nice(0)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    with pytest.raises(PriorityError, match=r"outside -20\.\.19"):
        apply_nice(-30)


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root here")
def test_an_account_without_cap_sys_nice_is_told_what_grants_it(tmp_path: Path) -> None:
    code = ("from kvpersist.serving.cpu_priority import apply_nice, PriorityError\n"
            "try:\n    apply_nice(-5)\nexcept PriorityError as exc:\n    print(exc)\n")
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), check=True)
    assert "needs CAP_SYS_NICE" in res.stdout and "KVP_SERVER_NICE=0" in res.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root here")
def test_every_thread_of_a_started_server_runs_at_the_configured_nice(tmp_path: Path) -> None:
    settings = load_settings(server_env(tmp_path / "cache", KVP_SERVER_NICE="-7"))
    start_server(settings)
    try:
        pid = server_pid(settings)
        assert thread_nices(pid) == {-7}
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "-7"
    finally:
        stop_server(settings)
