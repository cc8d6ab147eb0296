"""Which systemd unit holds the server: the recovery test refuses to restart a unit's server
itself and asks for KVP_SERVER_RESTART instead."""

from __future__ import annotations

import os
from pathlib import Path

from kvpersist.admin.recovery import systemd_unit_of


def _proc(tmp_path: Path, cgroup: str) -> Path:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(cgroup)
    return tmp_path


def test_the_unit_of_a_managed_server_is_found(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/system.slice/kvp-server.service\n")
    assert systemd_unit_of(42, proc) == "kvp-server.service"


def test_a_server_in_a_login_session_or_a_user_manager_is_not_a_unit(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/user.slice/user-1000.slice/session-3.scope\n")
    assert systemd_unit_of(42, proc) is None
    assert systemd_unit_of(7, proc) is None  # no such process


def test_this_process_is_read_from_the_real_proc() -> None:
    unit = systemd_unit_of(os.getpid())
    assert unit is None or unit.endswith(".service")
