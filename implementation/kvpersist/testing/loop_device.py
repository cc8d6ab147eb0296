"""Real block devices for the several-roots tests: an ext4 file system on a loop device, with
the faults a drive has in production (read-only remount, every I/O failing with EIO, the device
gone from its mount point) and its return.

The image lives on a private tmpfs, so the device is as fast as memory and nothing else on the
machine can stall it.  Needs root, ``losetup``, ``mkfs.ext4``, ``mount``; :func:`unavailable`
says why not where one is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: ext4's ``EXT4_IOC_SHUTDOWN`` (``_IOR('X', 125, __u32)``) with its default flag, which writes
#: everything out first: from then on every I/O of the file system fails with EIO, as a dead
#: drive's does, and what was written before is on the device when it is mounted again (the
#: other flags lose the last seconds of metadata, as a power cut does).
_EXT4_IOC_SHUTDOWN = 0x8004587D
_EXT4_GOING_FLAGS_DEFAULT = 0


def unavailable() -> str | None:
    """Why a loop file system cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (loop device, mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@dataclass
class LoopFilesystem:
    """An ext4 file system on ``device`` mounted at ``mount``."""

    mount: Path
    device: str

    def remount(self, *, read_only: bool) -> None:
        _run("mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(self.mount))

    def fail_every_io(self) -> None:
        """Shut the file system down: every read and write on it fails with EIO until it is
        mounted again (:meth:`mount_again`)."""
        fd = os.open(self.mount, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_DEFAULT))
        finally:
            os.close(fd)

    def unmount(self) -> None:
        """The device leaves its mount point (lazily, as a pulled drive's does): the empty
        directory under it shows."""
        _run("umount", "-l", str(self.mount))

    def mount_again(self) -> None:
        """Mount the device again (after :meth:`unmount` or :meth:`fail_every_io`)."""
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("umount", str(self.mount))
        _run("mount", self.device, str(self.mount))


@contextlib.contextmanager
def loop_filesystem(workdir: Path, *, size_mb: int) -> Iterator[LoopFilesystem]:
    """A fresh file system of ``size_mb`` at ``workdir/mnt``; undone on exit."""
    backing, mount = workdir / "backing", workdir / "mnt"
    backing.mkdir(parents=True, exist_ok=True)
    mount.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size_mb + 1}m,mode=0700", "tmpfs", str(backing))
    device = ""
    try:
        image = backing / "disk.img"
        with image.open("wb") as fh:
            fh.truncate(size_mb << 20)
        device = subprocess.run(["losetup", "--find", "--show", str(image)], check=True,
                                capture_output=True, text=True).stdout.strip()
        _run("mkfs.ext4", "-q", "-F", device)
        _run("mount", device, str(mount))
        yield LoopFilesystem(mount, device)
    finally:
        for _ in range(3):  # a lazily unmounted one may be mounted again by the test
            if subprocess.run(["umount", "-l", str(mount)], capture_output=True).returncode:
                break
        if device:
            subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        subprocess.run(["umount", "-l", str(backing)], check=False, capture_output=True)
