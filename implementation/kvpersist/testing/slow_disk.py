"""A slow disk for restore tests: an ext4 file system on a loop device whose reads are throttled
by the cgroup-v1 ``blkio`` controller for the processes admitted to it.

Only that device is slow: the rest of the machine (Python's libraries included) reads at full
speed, so a throttled LMCache server starts normally and only its L2 reads crawl.  The loop
device's image lives on a private tmpfs, so the throttle is the device's only limit: on the VM
disk, the loop driver's own reads of the image stalled for seconds behind other writeback while
the throttle kept dispatching (a CI run saw a restore at 5 MiB/s make no progress for 5 s and
be bypassed as stalled), which is a property of that machine, not of the restore.  Needs root,
``losetup``, ``mkfs.ext4`` and a writable ``/sys/fs/cgroup/blkio``; :func:`unavailable` says
why not where one is missing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..admin.page_cache import drop_page_cache, evict_files
from .loop_device import unavailable as loop_unavailable

BLKIO = Path("/sys/fs/cgroup/blkio")


def unavailable() -> str | None:
    """Why a slow disk cannot be made here, or None."""
    why = loop_unavailable()
    if why is not None:
        return why
    if not (BLKIO / "cgroup.procs").exists():
        return "no cgroup-v1 blkio controller at /sys/fs/cgroup/blkio"
    return None


drop_caches = drop_page_cache


@dataclass
class SlowDisk:
    mount: Path
    device: str  # /dev/loopN
    major_minor: str
    cgroup: Path

    def admit(self, pid: int) -> None:
        """Throttle the reads of ``pid`` (all its threads) on this device."""
        (self.cgroup / "cgroup.procs").write_text(f"{pid}\n")

    def evict_files(self) -> int:
        """Evict the page cache of every file on this disk
        (:func:`kvpersist.admin.page_cache.evict_files`): the next reads of them come from the
        slow device."""
        return evict_files(self.mount)

    def set_read_rate(self, bytes_per_s: int) -> None:
        """0 lifts the limit."""
        (self.cgroup / "blkio.throttle.read_bps_device").write_text(
            f"{self.major_minor} {bytes_per_s}\n")

    def set_write_rate(self, bytes_per_s: int) -> None:
        """0 lifts the limit.  Only writes the admitted processes submit themselves are
        throttled (O_DIRECT, kvpersist's default for L2 files); the page cache's writeback is
        not theirs in cgroup v1."""
        (self.cgroup / "blkio.throttle.write_bps_device").write_text(
            f"{self.major_minor} {bytes_per_s}\n")

    def read_bytes(self) -> int:
        """Bytes the admitted processes read from the device so far."""
        total = 0
        for line in (self.cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.major_minor and parts[1] == "Read":
                total += int(parts[2])
        return total


@contextlib.contextmanager
def throttle_group() -> Iterator[Path]:
    """A blkio cgroup, removed on exit (its processes are moved back to the root group first).
    Its throttles are per device: disks made in one group are limited each on its own, as
    separate drives are."""
    cgroup = BLKIO / f"kvpersist-slow-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (BLKIO / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            cgroup.rmdir()


@contextlib.contextmanager
def slow_disks(workdir: Path, count: int, *, size_mb: int, read_bytes_per_s: int,
               write_bytes_per_s: int = 0) -> Iterator[list[SlowDisk]]:
    """``count`` slow disks (``workdir/disk<i>/mnt``), each limited to the same rates on its own
    and sharing one cgroup, so one admitted process reads from all of them at up to ``count``
    times the rate (0 lifts a limit)."""
    with contextlib.ExitStack() as stack:
        cgroup = stack.enter_context(throttle_group())
        disks = [stack.enter_context(slow_disk(workdir / f"disk{i}", size_mb=size_mb,
                                               read_bytes_per_s=read_bytes_per_s,
                                               cgroup=cgroup))
                 for i in range(count)]
        for disk in disks:
            disk.set_write_rate(write_bytes_per_s)
        yield disks


@contextlib.contextmanager
def slow_disk(workdir: Path, *, size_mb: int, read_bytes_per_s: int,
              cgroup: Path | None = None) -> Iterator[SlowDisk]:
    """A fresh file system of ``size_mb`` at ``workdir/mnt`` reading at ``read_bytes_per_s`` for
    admitted processes; everything is undone on exit (admitted processes must be stopped).
    ``cgroup`` (from :func:`throttle_group`): the throttle group to add this device's limits to
    and leave in place; by default the disk has a group of its own."""
    if cgroup is None:
        with throttle_group() as own, slow_disk(workdir, size_mb=size_mb,
                                                read_bytes_per_s=read_bytes_per_s,
                                                cgroup=own) as disk:
            yield disk
        return
    backing, mount = workdir / "slow-backing", workdir / "mnt"
    image = backing / "slow.img"
    mount.mkdir(parents=True, exist_ok=True)
    backing.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb + 1}m,mode=0700", "tmpfs",
                    str(backing)], check=True, capture_output=True)
    device = ""
    try:
        with image.open("wb") as fh:
            fh.truncate(size_mb << 20)
        device = subprocess.run(["losetup", "--find", "--show", str(image)], check=True,
                                capture_output=True, text=True).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
        subprocess.run(["mount", device, str(mount)], check=True, capture_output=True)
        st = os.stat(device)
        disk = SlowDisk(mount, device, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", cgroup)
        disk.set_read_rate(read_bytes_per_s)
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        if device:
            subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        image.unlink(missing_ok=True)
        subprocess.run(["umount", "-l", str(backing)], check=False, capture_output=True)
