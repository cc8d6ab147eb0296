"""The suite's check for mounts and loop devices it leaves behind
(kvpersist.testing.mount_leftovers), on recorded ``/proc`` and ``/sys`` text and on a real mount."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvpersist.testing.mount_leftovers import leftovers, loop_devices, mount_points, snapshot

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
35 22 0:31 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
90 22 0:45 / /tmp/pytest-of-root/pytest-7/slow/mnt rw,relatime shared:40 - ext4 /dev/loop3 rw
"""


def _sys_block(root: Path, loops: dict[str, str | None]) -> Path:
    for name, backing in loops.items():
        (root / name).mkdir(parents=True)
        if backing is not None:
            (root / name / "loop").mkdir()
            (root / name / "loop" / "backing_file").write_text(backing + "\n")
    return root


def test_new_mounts_and_attached_loop_devices_are_named(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO.splitlines(keepends=True)[0] + MOUNTINFO.splitlines(keepends=True)[1])
    block = _sys_block(tmp_path / "block", {"loop0": "/var/lib/snap.img", "loop1": None})
    before = snapshot(mountinfo=info, sys_block=block)
    assert before == {"mounts": {"/": "ext4", "/dev/shm": "tmpfs"},
                      "loops": {"/dev/loop0": "/var/lib/snap.img"}}
    assert leftovers(before, mountinfo=info, sys_block=block) == []
    info.write_text(MOUNTINFO)
    (block / "loop1" / "loop").mkdir()
    (block / "loop1" / "loop" / "backing_file").write_text("/tmp/x/slow-backing/disk.img\n")
    assert leftovers(before, mountinfo=info, sys_block=block) == [
        "mount /tmp/pytest-of-root/pytest-7/slow/mnt (ext4)",
        "loop device /dev/loop1 backed by /tmp/x/slow-backing/disk.img"]


def test_a_device_reattached_to_another_file_is_new_and_unreadable_sources_are_empty(
        tmp_path: Path) -> None:
    block = _sys_block(tmp_path / "block", {"loop0": "/a.img"})
    before = {"mounts": {}, "loops": {"/dev/loop0": "/old.img"}}
    assert leftovers(before, mountinfo=tmp_path / "none", sys_block=block) == [
        "loop device /dev/loop0 backed by /a.img"]
    assert mount_points(tmp_path / "none") == {}
    assert loop_devices(tmp_path / "no-block") == {}


def test_a_real_tmpfs_is_reported_until_it_is_unmounted(tmp_path: Path) -> None:
    where = tmp_path / "mnt"
    where.mkdir()
    before = snapshot()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()})")
    try:
        assert f"mount {where} (tmpfs)" in leftovers(before)
    finally:
        subprocess.run(["umount", str(where)], check=True)
    assert f"mount {where} (tmpfs)" not in leftovers(before)
