"""What a shared (network or distributed) file system under the cache tree means for kvpersist:
which one it is, whether the per-node lock can be taken, and how stale another node's files may
look through this mount's caches.

Invariants: pure over the text of ``/proc/mounts`` and the FUSE client's command line (tests pass
both); never a wrong token in any case, since every read is verified, so staleness is reported as
*late hits and extra misses*, and only what would break a promise (no ``flock``) is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: File-system types of /proc/mounts that several nodes can mount, by family.
SHARED_FS = {
    "fuse.glusterfs": "glusterfs", "glusterfs": "glusterfs",
    "nfs": "nfs", "nfs4": "nfs",
    "lustre": "lustre",
    "wekafs": "wekafs",
    "ceph": "ceph", "fuse.ceph": "ceph", "fuse.ceph-fuse": "ceph",
    "gpfs": "gpfs",
}
#: GlusterFS's FUSE defaults when the mount does not set them (mount.glusterfs(8)).
GLUSTER_DEFAULTS = {"attribute-timeout": 1.0, "entry-timeout": 1.0, "negative-timeout": 0.0}
#: Linux NFS attribute-cache defaults, seconds (nfs(5)).
NFS_DEFAULTS = {"acregmin": 3.0, "acregmax": 60.0, "acdirmin": 30.0, "acdirmax": 60.0}


@dataclass(frozen=True)
class MountView:
    family: str  # a SHARED_FS value
    fs_type: str
    mount_point: str
    options: dict[str, str]  # mount options, FUSE client options included
    level: str  # "ok" | "warn" | "error"
    message: str


def mount_options(text: str) -> dict[str, str]:
    """``a,b=1`` → {"a": "", "b": "1"}."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def gluster_client_options(mount_point: str, proc: Path = Path("/proc")) -> dict[str, str]:
    """The ``--attribute-timeout=...`` style options of the glusterfs FUSE client serving
    ``mount_point`` (read from its command line; {} when it cannot be found)."""
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            argv = (proc / pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if not args or not os.path.basename(args[0]).startswith("glusterfs"):
            continue
        if args[-1].rstrip("/") != mount_point.rstrip("/"):
            continue
        found = {}
        for arg in args[1:]:
            if arg.startswith("--") and "=" in arg:
                key, _, value = arg[2:].partition("=")
                found[key] = value
        return found
    return {}


def _seconds(options: dict[str, str], name: str, default: float) -> float:
    try:
        return float(options[name])
    except (KeyError, ValueError):
        return default


def describe_mount(fs_type: str, mount_point: str, options: dict[str, str]) -> MountView:
    """The staleness and locking of one shared mount, in an operator's words."""
    family = SHARED_FS[fs_type]
    if family == "glusterfs":
        t = {k: _seconds(options, k, v) for k, v in GLUSTER_DEFAULTS.items()}
        worst = max(t["attribute-timeout"], t["entry-timeout"])
        settings = ", ".join(f"{k}={v:g}" for k, v in t.items())
        if worst > 0:
            return MountView(family, fs_type, mount_point, options, "warn",
                             f"{settings}: a file another node publishes or replaces may be seen "
                             f"up to {worst:g}s late (a miss, or a verified older copy; never a "
                             "wrong token). For the freshest view mount with "
                             "entry-timeout=0,attribute-timeout=0,negative-timeout=0 and turn "
                             "the volume's caching translators off (performance.stat-prefetch, "
                             "quick-read, io-cache, read-ahead, open-behind, readdir-ahead); "
                             "flock works across mounts")
        return MountView(family, fs_type, mount_point, options, "ok",
                         f"{settings}: other nodes' files are seen at once (also turn the "
                         "volume's caching translators off); flock works across mounts")
    if family == "nfs":
        if "noac" in options or options.get("actimeo") == "0":
            return MountView(family, fs_type, mount_point, options, "ok",
                             "noac: no attribute caching, other nodes' files are seen at once "
                             "(every lookup asks the server); flock is mapped to NFS locks, "
                             "which hold across clients")
        t = {k: _seconds(options, "actimeo", _seconds(options, k, v))
             for k, v in NFS_DEFAULTS.items()}
        lookup = options.get("lookupcache", "all")
        return MountView(family, fs_type, mount_point, options, "warn",
                         f"attribute cache acregmax={t['acregmax']:g}s acdirmax={t['acdirmax']:g}s"
                         f", lookupcache={lookup}: another node's new file may be missed for up "
                         f"to {max(t['acdirmax'], t['acregmax']):g}s and a replaced one read "
                         "late (misses and verified older copies; never a wrong token). "
                         "actimeo=1 (or noac) and lookupcache=positive bound it; flock is "
                         "mapped to NFS locks, which hold across clients")
    if family == "lustre":
        if "flock" not in options:
            return MountView(family, fs_type, mount_point, options, "error",
                             "mounted without -o flock: the per-node lock cannot be taken "
                             "(flock fails with ENOSYS, or with localflock it is not seen by "
                             "other clients); remount with -o flock")
        return MountView(family, fs_type, mount_point, options, "ok",
                         "coherent across clients (distributed locks); flock enabled")
    if family == "wekafs":
        return MountView(family, fs_type, mount_point, options, "warn",
                         "coherent across clients. GDS profile (seed 2): with GPUs, "
                         "KVP_L2_ADAPTER=nixl_store_dynamic with backend GDS (or GDS_MT), GDS "
                         "forced on, and the GDS buffer budgeted against "
                         "--gpu-memory-utilization (start with 8 GiB and 0.85 on an 80 GiB GPU); "
                         "that adapter has no read checksum and no shared-tree mode, so keep "
                         "KVP_L2_ADAPTER=kvpersist where a verified read matters more than GDS")
    if family == "ceph":
        return MountView(family, fs_type, mount_point, options, "ok",
                         "coherent across clients (capabilities); flock is supported")
    return MountView(family, fs_type, mount_point, options, "ok",
                     "coherent across clients (token locks); flock is supported")
