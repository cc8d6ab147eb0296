"""Which systemd unit holds the server: the recovery test refuses to restart a unit's server
itself and asks for KVP_SERVER_RESTART instead."""

from __future__ import annotations

import os
from pathlib import Path

from kvpersist.admin.recovery import DeviceReads, root_devices, systemd_unit_of


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


def _diskstats(path: Path, reads: dict[str, int]) -> Path:
    path.write_text("".join(f"   7       {i} {dev} 10 0 {sectors} 5 0 0 0 0 0 0 0\n"
                            for i, (dev, sectors) in enumerate(reads.items())))
    return path


def test_scenario_b_evidence_is_a_read_from_any_roots_device(tmp_path: Path) -> None:
    """A chat's chunks are spread over the roots: a read from any root's device is evidence,
    and each device is named; no read from any of them is a FAIL."""
    stats = tmp_path / "diskstats"
    roots = [(tmp_path / "r0", "loop0"), (tmp_path / "r1", "loop1")]
    before = DeviceReads.take(roots, _diskstats(stats, {"loop0": 100, "loop1": 200}))
    assert before.unknown() == []
    ok, detail = before.verdict(_diskstats(stats, {"loop0": 100, "loop1": 264}))
    assert ok is True
    assert "loop0: 100 -> 100 sectors read" in detail and "loop1: 200 -> 264" in detail
    ok, detail = before.verdict(_diskstats(stats, {"loop0": 100, "loop1": 200}))
    assert ok is False and "loop1: 200 -> 200" in detail


def test_scenario_b_without_any_countable_device_is_inconclusive(tmp_path: Path) -> None:
    stats = _diskstats(tmp_path / "diskstats", {"loop0": 100})
    reads = DeviceReads.take([(tmp_path / "r0", None), (tmp_path / "r1", "nvme9n1")], stats)
    assert reads.unknown() == [tmp_path / "r0", tmp_path / "r1"]
    ok, detail = reads.verdict(stats)
    assert ok is None
    assert "no block device" in detail and "nvme9n1: not in diskstats" in detail
    # one countable root is enough to decide
    mixed = DeviceReads.take([(tmp_path / "r0", None), (tmp_path / "r1", "loop0")], stats)
    assert mixed.verdict(_diskstats(tmp_path / "diskstats", {"loop0": 108}))[0] is True


def test_the_named_device_stands_for_the_first_root_only(tmp_path: Path) -> None:
    found = root_devices([tmp_path, tmp_path], "/dev/nvme7n1")
    assert found[0] == (tmp_path, "nvme7n1")
    assert found[1][1] != "nvme7n1"  # the second root's own device (or none), not the named one
