"""The test suite's own check that it leaves no mount and no loop device behind
(``scripts/test.sh``, beside :mod:`kvpersist.testing.shm_leftovers`).

The suite mounts real file systems (tmpfs, ext4 on loop devices throttled by a cgroup, FUSE
mounts of a GlusterFS volume) and detaches them when a test ends, also when it fails.  A run
interrupted at the wrong moment once left a slow disk mounted for a day: its loop device kept
a tmpfs image in RAM and the next run found a stranger in ``losetup``.

``snapshot FILE`` records the mount points and the attached loop devices present before the
run; ``check FILE`` lists those that appeared since and exits 1 naming them with what backs
them.  Anything present before the run is not the run's and is never reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
SYS_BLOCK = Path("/sys/block")


def mount_points(mountinfo: Path = MOUNTINFO) -> dict[str, str]:
    """Mount point → file system type of every mount this process sees (octal escapes of
    ``mountinfo``, such as ``\\040`` for a space, are kept as written)."""
    found: dict[str, str] = {}
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) > dash + 1 and len(fields) > 4:
            found[fields[4]] = fields[dash + 1]
    return found


def loop_devices(sys_block: Path = SYS_BLOCK) -> dict[str, str]:
    """Attached loop device → its backing file (a detached device has no ``loop/backing_file``)."""
    found: dict[str, str] = {}
    try:
        entries = sorted(sys_block.glob("loop*"))
    except OSError:
        return found
    for entry in entries:
        try:
            found[f"/dev/{entry.name}"] = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
    return found


def leftovers(before: dict[str, dict[str, str]], *, mountinfo: Path = MOUNTINFO,
              sys_block: Path = SYS_BLOCK) -> list[str]:
    """What appeared since ``before`` (a :func:`snapshot`), one line each."""
    mounts = mount_points(mountinfo)
    loops = loop_devices(sys_block)
    left = [f"mount {point} ({fstype})" for point, fstype in sorted(mounts.items())
            if point not in before.get("mounts", {})]
    left += [f"loop device {dev} backed by {backing}" for dev, backing in sorted(loops.items())
             if before.get("loops", {}).get(dev) != backing]
    return left


def snapshot(*, mountinfo: Path = MOUNTINFO,
             sys_block: Path = SYS_BLOCK) -> dict[str, dict[str, str]]:
    return {"mounts": mount_points(mountinfo), "loops": loop_devices(sys_block)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpersist.testing.mount_leftovers",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("action", choices=("snapshot", "check"))
    parser.add_argument("file", type=Path, help="where the snapshot is kept")
    args = parser.parse_args(argv)
    if args.action == "snapshot":
        args.file.write_text(json.dumps(snapshot()))
        return 0
    left = leftovers(json.loads(args.file.read_text()))
    if left:
        print(f"mounts or loop devices left behind by the run ({len(left)}):\n  "
              + "\n  ".join(left), file=sys.stderr)
        return 1
    print("no mount or loop device left behind by the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
