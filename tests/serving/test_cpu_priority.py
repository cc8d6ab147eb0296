"""``KVP_SERVER_NICE``: the server runs ahead of vLLM's spinning workers when asked, every thread
of it, and a priority it may not take stops it with a message instead of running without."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.serving.server.cpu_priority import PriorityError, apply_nice
from kvpersist.serving.server.lifecycle import start_server, stop_server
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


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None
                    or not os.path.exists(SYSTEM_PYTHON),
                    reason="needs root, setpriv and a system python3 that uid 65534 may run")
def test_an_account_without_cap_sys_nice_is_told_what_grants_it() -> None:
    """Run as uid 65534, which may not raise a priority.  The module uses the standard library
    only, so it is copied where that account may read it (a clean clone is not)."""
    from kvpersist.serving.server import cpu_priority

    base = Path(tempfile.mkdtemp(prefix="kvp-nice-", dir="/tmp"))
    try:
        base.chmod(0o755)
        shutil.copy(cpu_priority.__file__, base / "cpu_priority.py")
        (base / "cpu_priority.py").chmod(0o644)
        code = ("from cpu_priority import apply_nice, PriorityError\n"
                "try:\n    apply_nice(-5)\nexcept PriorityError as exc:\n    print(exc)\n")
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                             cwd=base, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(base)},
                             check=True, timeout=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert "needs CAP_SYS_NICE" in res.stdout and "KVP_SERVER_NICE=0" in res.stdout


@pytest.mark.serial  # a server at raised priority starves the other worker
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
