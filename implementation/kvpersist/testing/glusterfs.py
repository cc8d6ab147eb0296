"""A real GlusterFS volume for shared-tree tests: glusterd on 127.0.0.2, a two-brick volume on
local directories, mounted several times through FUSE as the nodes of a cluster would mount it.

Facts this relies on (measured on this machine kind, see issue 13): glusterd refuses 127.0.0.1 and
``localhost`` but runs on 127.0.0.2 (all of 127/8 is loopback); the ``gluster`` command must talk
to glusterd over its local socket (a ``--remote-host`` CLI is read-only); PID 1 is not systemd, so
the daemons are started directly; bricks on the root file system need ``force``.

Invariants: everything started here is stopped and unmounted on exit, also when a test fails;
:func:`unavailable` says why no volume can be made (not root, GlusterFS not installed, no FUSE),
and the tests skip with that reason.  Needs the packages ``glusterfs-server glusterfs-client``
(``scripts/install-glusterfs.sh``, run by ``scripts/test.sh``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.2"
#: One glusterd per machine (its port and local socket are fixed): test modules that start one
#: hold this lock while it runs, so two test workers take turns instead of one skipping.
MACHINE_LOCK = Path("/tmp/kvpersist-glusterd.lock")
#: The caching translators that let a mount serve stale data (seen: a stale version for ~1 s).
CACHING_TRANSLATORS = ("performance.stat-prefetch", "performance.quick-read",
                       "performance.io-cache", "performance.read-ahead",
                       "performance.open-behind", "performance.readdir-ahead")
COHERENT_MOUNT_OPTIONS = "entry-timeout=0,attribute-timeout=0,negative-timeout=0"
#: The GlusterFS processes' CPU priority: the cache server's in the shared-tree tests
#: (``KVP_SERVER_NICE=-10``), whose every read of the tree waits on them.  At nice 0 the two
#: tensor-parallel vLLM workers, each pinned to one of the machine's two cores and
#: busy-polling while a request waits for its cache lookup, left them no CPU for up to 61 s
#: (a nice -20 canary in a session of autogroup nice 0 slept 61 s late at the same moments;
#: a SCHED_FIFO one never did): the lookup of six files took 19-61 s, and in a CI run over 60 s, given up.
DAEMON_NICE = -10
DAEMON_NAMES = ("glusterd", "glusterfsd", "glusterfs")
_GLUSTERD_VOL = """volume management
    type mgmt/glusterd
    option working-directory {workdir}
    option transport.socket.bind-address {host}
    option transport-type socket
    option transport.socket.listen-port 24007
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
"""


def unavailable() -> str | None:
    """Why no GlusterFS volume can be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (glusterd, FUSE mounts)"
    for tool in ("glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None:
            return (f"{tool} is not installed (apt-get install glusterfs-server glusterfs-client; "
                    "scripts/install-glusterfs.sh)")
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse"
    if Path("/var/run/glusterd.socket").exists() and _glusterd_running():
        return "a glusterd already runs on this machine; the tests start their own"
    return None


@contextlib.contextmanager
def machine_turn(lock: Path = MACHINE_LOCK) -> Iterator[None]:
    """Hold the machine's GlusterFS turn (:data:`MACHINE_LOCK`) for the block; waits for the
    holder to finish.  The lock is the kernel's (``flock``): a holder that dies releases it."""
    with open(lock, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _glusterd_running() -> bool:
    """A glusterd answers on its local socket (a dead one's socket file refuses)."""
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect("/var/run/glusterd.socket")
        except OSError:
            return False
    return True


def gluster(*args: str, timeout: float = 60.0) -> str:
    """Run the ``gluster`` CLI (script mode); raises with its output on failure."""
    proc = subprocess.run(["gluster", "--mode=script", *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"gluster {' '.join(args)}: {proc.stdout}{proc.stderr}".strip())
    return proc.stdout


@dataclass
class GlusterVolume:
    name: str
    workdir: Path
    bricks: list[Path]
    mounts: list[Path] = field(default_factory=list)

    def brick_pids(self) -> dict[Path, int]:
        """brick directory → its glusterfsd pid (from the volume's status)."""
        pids: dict[Path, int] = {}
        for brick in self.bricks:
            pid_file = Path(f"/var/run/gluster/vols/{self.name}/"
                            f"{HOST}-{str(brick).strip('/').replace('/', '-')}.pid")
            with contextlib.suppress(OSError, ValueError):
                pids[brick] = int(pid_file.read_text().strip())
        return pids

    def kill_brick(self, brick: Path) -> None:
        """SIGKILL one brick's server, as a failed disk or node would stop it."""
        pid = self.brick_pids()[brick]
        os.kill(pid, signal.SIGKILL)
        # Until it is reaped (by init; not our child), not merely gone (processes.wait_gone):
        # seen, a ``volume start force`` while it was still a zombie left the brick down.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart_bricks(self) -> None:
        """``volume start <name> force``: brings killed bricks back (at :data:`DAEMON_NICE`)."""
        gluster("volume", "start", self.name, "force")
        raise_daemon_priority()

    def mount(self, where: Path) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "glusterfs", "-o", COHERENT_MOUNT_OPTIONS,
                        f"{HOST}:/{self.name}", str(where)], check=True, capture_output=True,
                       timeout=60)
        self.mounts.append(where)
        return where


@contextlib.contextmanager
def gluster_volume(workdir: Path, *, mounts: int = 2, bricks: int = 2) -> Iterator[GlusterVolume]:
    """A fresh volume of ``bricks`` bricks under ``workdir``, mounted ``mounts`` times at
    ``workdir/mnt-<i>`` with the caching translators off; all undone on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    state = workdir / "glusterd"
    state.mkdir(exist_ok=True)
    volfile = workdir / "glusterd.vol"
    volfile.write_text(_GLUSTERD_VOL.format(workdir=state, host=HOST))
    name = f"kvp{uuid.uuid4().hex[:8]}"
    volume = GlusterVolume(name, workdir, [workdir / f"brick-{i}" for i in range(bricks)])
    subprocess.run(["glusterd", "-f", str(volfile), "-p", str(workdir / "glusterd.pid"),
                    "-l", str(workdir / "glusterd.log")], check=True, capture_output=True,
                   timeout=60)
    created = False
    try:
        _wait_for_glusterd()
        for brick in volume.bricks:
            brick.mkdir(exist_ok=True)
        gluster("volume", "create", name, *(f"{HOST}:{b}" for b in volume.bricks), "force")
        created = True
        for option in CACHING_TRANSLATORS:
            gluster("volume", "set", name, option, "off")
        gluster("volume", "start", name)
        for i in range(mounts):
            volume.mount(workdir / f"mnt-{i}")
        raise_daemon_priority()
        yield volume
    finally:
        for where in volume.mounts:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        if created:
            with contextlib.suppress(Exception):
                gluster("volume", "stop", name, "force")
            with contextlib.suppress(Exception):
                gluster("volume", "delete", name)
        for pid in volume.brick_pids().values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _stop_glusterd(workdir / "glusterd.pid")


def raise_daemon_priority(nice: int = DAEMON_NICE,
                          names: tuple[str, ...] = DAEMON_NAMES) -> list[int]:
    """Every process of the machine whose name is one of ``names`` (the GlusterFS daemons;
    while the machine's turn is held they are this volume's) at ``nice``: each of its threads,
    and the autogroup of its session (each daemon is its own session, and across sessions only
    the autogroup's nice value counts).  Returns their pids."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().strip() not in names:
                continue
            for task in (entry / "task").iterdir():
                with contextlib.suppress(OSError):  # a thread that has just ended
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            with contextlib.suppress(OSError):  # a kernel without autogroup
                (entry / "autogroup").write_text(f"{nice}\n")
            pids.append(int(entry.name))
    return pids


def _wait_for_glusterd(timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            gluster("volume", "list", timeout=10)
            return
        except (RuntimeError, subprocess.TimeoutExpired):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _stop_glusterd(pid_file: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
