"""Pre-start checks for an operator: can this machine keep the promises of the configuration?

Invariants: every check yields ``ok``, ``warn`` or ``error`` with a message that says how to fix
it; preflight reads and probes, and never changes anything (no directory is created).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config.adapters import l2_adapter_config
from ..config.environment import TELEMETRY_OFF
from ..config.server import (
    ServerSettings,
    SettingsError,
    access_warning,
    describe_access,
)
from ..identity import FIELDS, IdentityError, load_pins
from ..identity.fields import OPTIONAL_FIELDS
from ..l2.inventory import InventoryError, build_inventory
from ..serving.lmcache_compat import pins as lmcache_pins
from ..serving.server.host_memory import MEMINFO, l1_refusal, mem_available_bytes
from ..serving.server.lifecycle import is_healthy, port_is_free
from ..serving.server.private_paths import PrivatePathError, check_private_dir
from .budget import BudgetModel, device_ceiling
from .compat import CompatError, CompatReport, check_installed
from .pins_writer import ENGINE_ONLY
from .restore_limits import describe, restore_limits
from .shared_fs import SHARED_FS, describe_mount, gluster_client_options, mount_options

LOCAL_FS_OK = {"ext4", "xfs", "btrfs", "zfs", "f2fs", "ext3", "bcachefs"}
TEST_ONLY_FS = {"tmpfs", "overlay", "overlayfs", "ramfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse.sshfs", "lustre",
              "beegfs", "gpfs", "9p", "fuse.glusterfs", "fuse.ceph", "fuse.juicefs"}


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # "ok" | "warn" | "error"
    message: str


def mount_entry(path: Path, mounts: str = "/proc/mounts") -> tuple[str, str, str]:
    """(fs type, mount point, options) of ``path`` from the longest matching mount point."""
    target = str(path.resolve() if path.exists() else Path(os.path.abspath(path)))
    best = ("unknown", "", "")
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/") or mount == "/"
        if inside and len(mount) >= len(best[1]):
            best = (parts[2], mount, parts[3])
    return best


def fs_type(path: Path, mounts: str = "/proc/mounts") -> tuple[str, str]:
    """(fs type, mount point) of ``path`` from the longest matching mount point."""
    kind, mount, _ = mount_entry(path, mounts)
    return kind, mount


def existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_check(root: Path, *, production: bool, mounts: str = "/proc/mounts",
                     shared: bool = False, proc: Path = Path("/proc")) -> Check:
    """``shared``: the tree is meant to be shared by nodes (``KVP_NODE_ID`` is set)."""
    kind, mount, option_text = mount_entry(root, mounts)
    where = f"{root} is on {kind} (mounted at {mount})"
    if kind in SHARED_FS:
        options = mount_options(option_text)
        if SHARED_FS[kind] == "glusterfs":
            options.update(gluster_client_options(mount, proc))
        view = describe_mount(kind, mount, options)
        if shared:
            return Check("filesystem", view.level, f"{where}, shared by nodes: {view.message}")
        return Check("filesystem", "error" if view.level == "error" else "warn",
                     f"{where}: a file system several nodes can mount, used by one node. To "
                     "share the tree, give each node KVP_NODE_ID (and KVP_SHARED_NODES); "
                     f"otherwise keep one server per tree. {view.message}")
    if shared:
        return Check("filesystem", "warn",
                     f"{where}: KVP_NODE_ID is set but this is not a shared file system; other "
                     "nodes cannot see this tree (fine for several servers on one host)")
    if kind in TEST_ONLY_FS:
        return Check("filesystem", "warn" if production else "ok",
                     f"{where}: fine for tests; in production it does not persist across reboots "
                     "(tmpfs) or lives in a container layer (overlay): use a local NVMe file system")
    if kind in NETWORK_FS or kind.startswith("fuse."):
        return Check("filesystem", "warn",
                     f"{where}: a network file system kvpersist has no profile for: atomic "
                     "rename and the lock across clients are not guaranteed. Use a local NVMe "
                     "file system, or a shared one kvpersist knows (GlusterFS, NFS, Lustre, "
                     "WekaFS, CephFS, GPFS)")
    if kind in LOCAL_FS_OK:
        return Check("filesystem", "ok", where)
    return Check("filesystem", "warn", f"{where}: not a file system kvpersist was tested on")


def access_check(settings: ServerSettings) -> Check:
    """Which access mode is on: ``unix`` is ok; ``tcp`` (open to every local account) warns."""
    warning = access_warning(settings)
    if warning:
        return Check("access", "warn", warning.removeprefix("WARNING: "))
    return Check("access", "ok", f"KVP_ACCESS={settings.access}: {describe_access(settings)}")


def runtime_dir_check(settings: ServerSettings, *, running: bool) -> Check:
    where = settings.socket_dir
    if not os.path.lexists(where):
        return Check("runtime dir", "ok", f"{where} will be created (mode "
                     f"{'0750' if settings.access_group else '0700'})")
    try:
        check_private_dir(where, "KVP_RUNTIME_DIR", group=settings.access_gid)
    except (PrivatePathError, SettingsError) as exc:
        return Check("runtime dir", "error", f"{exc}; the server refuses to start")
    state = "the running server's sockets" if running else "no server answers there"
    return Check("runtime dir", "ok", f"{where} is private ({state})")


def port_checks(settings: ServerSettings, *, running: bool) -> list[Check]:
    checks = []
    for name, port in (("KVP_ZMQ_PORT", settings.zmq_port), ("KVP_HTTP_PORT", settings.http_port)):
        if running:
            checks.append(Check(f"port {name}", "ok", f"{port} is served by the running server"))
        elif port_is_free(settings.bind_host, port):
            checks.append(Check(f"port {name}", "ok", f"{port} is free on {settings.bind_host}"))
        else:
            checks.append(Check(f"port {name}", "error",
                                f"{port} is busy on {settings.bind_host}; stop what uses it or "
                                f"set {name}"))
    return checks


def compatibility_checks(report: CompatReport | None, error: str | None = None) -> list[Check]:
    """The installed versions against the tested ones, every fence feature that would be off,
    and whether the connector's gate would close: what vLLM would say at start, known before
    anything starts (read from the installed sources, nothing imported)."""
    if report is None:
        return [Check("versions", "error", f"cannot read the installed vLLM/LMCache: {error}")]
    tested = lmcache_pins.TESTED_VERSIONS
    found = {"vllm": report.vllm.version, "lmcache": report.lmcache.version}
    other = [f"{name} {found[name] or 'unknown'} (tested: {tested[name]})" for name in tested
             if found[name] != tested[name]]
    checks = [Check("versions", "warn" if other else "ok",
                    ("not the tested versions: " + ", ".join(other) + "; the checks below "
                     "decide what runs") if other else
                    ", ".join(f"{n} {v}" for n, v in found.items()) + " (the tested versions)")]
    for feature in report.features:
        if not feature.on:
            changed = ", ".join(c.qualname for c in feature.changed)
            checks.append(Check(f"fence {feature.name}",
                                "error" if feature.unsafe_without else "warn",
                                f"off: changed {changed}; {feature.if_off}"))
    on = [f.name for f in report.features if f.on]
    if on:
        checks.append(Check("fence", "ok", "on: " + ", ".join(on)))
    if report.gate_closes:
        checks.append(Check("gate", "error", "the connector's gate would close, vLLM serving "
                            "uncached: " + "; ".join(report.gate_reasons)
                            + " (docs/upgrading.md)"))
    elif report.breaking:
        checks.append(Check("gate", "error", "the connector would not load: "
                            + "; ".join(f"{f.name}: {f.detail}" for f in report.breaking)))
    else:
        checks.append(Check("gate", "ok", "the connector's gate would open"))
    return checks


def memory_check(settings: ServerSettings, *, running: bool, meminfo: Path = MEMINFO) -> Check:
    """L1 against the host's available memory (the running server's L1 is already taken)."""
    l1 = f"KVP_L1_SIZE_GB={settings.l1_size_gb:g}"
    if running:
        return Check("L1 memory", "ok", f"{l1}: allocated by the running server")
    available = mem_available_bytes(meminfo)
    refusal = l1_refusal(settings, available)
    if refusal is not None:
        return Check("L1 memory", "error", refusal + "; the server refuses to start")
    if available is None:
        return Check("L1 memory", "warn", f"{l1}: this host does not report MemAvailable")
    return Check("L1 memory", "ok", f"{l1} of {available / 2**30:.1f} GiB available")


def run_preflight(settings: ServerSettings, *, cache_bytes: int, pins: Path | None,
                  production: bool = True, device: Path | None = None,
                  environ: dict[str, str] | None = None,
                  compat: CompatReport | None = None) -> list[Check]:
    """Every check; ``compat``: the installed versions' report (default: read now)."""
    env = dict(os.environ if environ is None else environ)
    checks: list[Check] = []
    if compat is None:
        try:
            compat = check_installed()
        except CompatError as exc:
            checks.extend(compatibility_checks(None, str(exc)))
    if compat is not None:
        checks.extend(compatibility_checks(compat))
    budget = BudgetModel.from_gb(settings.node_budget_gb, settings.eviction_watermark,
                                 settings.eviction_ratio)
    root = settings.cache_root
    probe = existing_ancestor(root)

    ceiling = device_ceiling(probe, cache_bytes, budget.cap_bytes, device)
    checks.append(Check("device ceiling", "ok" if ceiling.ok else "error", ceiling.message()))

    free_share = ceiling.free_bytes / max(1, budget.cap_bytes)
    if ceiling.free_bytes < 1024**3:
        checks.append(Check("free space", "error",
                            f"only {ceiling.free_bytes / 1024**2:.0f} MiB free on {probe}: stores "
                            "would fail at once; free space or move KVP_CACHE_ROOT"))
    else:
        checks.append(Check("free space", "ok",
                            f"{ceiling.free_bytes / 1024**3:.1f} GiB free on {probe} "
                            f"({100 * free_share:.0f}% of the budget)"))

    if root.exists() and not os.access(root, os.W_OK | os.X_OK):
        checks.append(Check("cache root", "error", f"{root} is not writable by this user"))
    elif root.exists():
        try:
            check_private_dir(root, "KVP_CACHE_ROOT", allow_symlink=True)
            checks.append(Check("cache root", "ok", f"{root} exists, private to this account"))
        except PrivatePathError as exc:
            checks.append(Check("cache root", "error", f"{exc}; the server refuses to start"))
    else:
        checks.append(Check("cache root", "ok", f"{root} will be created (mode 0700)"))

    running = is_healthy(settings, timeout=1.0)
    checks.append(memory_check(settings, running=running))
    checks.append(access_check(settings))
    if settings.unix_sockets:
        checks.append(runtime_dir_check(settings, running=running))
    else:
        checks.extend(port_checks(settings, running=running))

    adapter = l2_adapter_config(settings)
    checks.append(Check("persist_enabled", "ok" if adapter.get("persist_enabled") else "error",
                        f"L2 adapter {settings.l2_adapter}: persist_enabled="
                        f"{adapter.get('persist_enabled')}"))
    if settings.l2_adapter != "kvpersist":
        checks.append(Check("read verification", "warn",
                            f"{settings.l2_adapter} has no read checksum and does not restore its "
                            "capacity count after a restart; KVP_L2_ADAPTER=kvpersist verifies "
                            "every read"))

    shell_telemetry = env.get("LMCACHE_TRACK_USAGE", "").lower() in ("1", "true", "yes")
    checks.append(Check("telemetry", "ok",
                        "forced off for every server kvpersist starts ("
                        + " ".join(f"{k}={v}" for k, v in TELEMETRY_OFF.items()) + ")"
                        + ("; note: this shell sets LMCACHE_TRACK_USAGE=true, which kvpersist "
                           "overrides" if shell_telemetry else "")))

    if pins is not None:
        try:
            pinned = load_pins(pins)
            missing = [f.env for f in FIELDS if f.name not in pinned
                       and f.name not in ENGINE_ONLY and f.name not in OPTIONAL_FIELDS]
            checks.append(Check("identity pins", "error" if missing else "ok",
                                f"{pins}: missing {', '.join(missing)}" if missing else
                                f"{pins}: every field pinned (the build and the weights "
                                "digest come from the engine)"))
            try:
                level, message = describe(restore_limits(pinned, settings))
                checks.append(Check("restore size", level, message))
            except ValueError as exc:
                checks.append(Check("restore size", "warn", f"{pins}: {exc}; the largest "
                                    "restorable conversation is unknown"))
        except IdentityError as exc:
            checks.append(Check("identity pins", "error", str(exc)))

    checks.append(filesystem_check(root, production=production, shared=settings.shared))
    if settings.extra_roots:
        checks.extend(roots_checks(settings.l2_roots, budget.cap_bytes))
    return checks


def roots_checks(roots: tuple[Path, ...], budget_bytes: int) -> list[Check]:
    """Several roots: each writable, with free space for its equal share, and each on its own
    device (two roots on one device add no bandwidth, and one fault costs both)."""
    checks: list[Check] = []
    share = budget_bytes // len(roots)
    devices: dict[int, Path] = {}
    for root in roots:
        probe = existing_ancestor(root)
        try:
            st, fs = os.stat(probe), os.statvfs(probe)
        except OSError as exc:
            checks.append(Check(f"root {root}", "error", f"cannot be read ({exc.strerror})"))
            continue
        free = fs.f_bavail * fs.f_frsize
        if not os.access(probe, os.W_OK | os.X_OK):
            level, text = "error", f"{probe} is not writable by this user"
        elif free + _used_below(root) < share:
            level, text = "warn", (f"{free / 1024**3:.1f} GiB free, less than its share of "
                                   f"{share / 1024**3:.1f} GiB: stores there are refused once "
                                   "the device fills")
        else:
            level, text = "ok", (f"{free / 1024**3:.1f} GiB free for a share of "
                                 f"{share / 1024**3:.1f} GiB")
        if st.st_dev in devices:
            level = "error" if level == "error" else "warn"
            text += (f"; on the same device as {devices[st.st_dev]}: no bandwidth is gained and "
                     "one fault costs both")
        devices.setdefault(st.st_dev, root)
        checks.append(Check(f"root {root}", level, text))
    return checks


def _used_below(root: Path) -> int:
    """Bytes the tier's own files already take under ``root`` (they count in its share)."""
    try:
        return build_inventory(root).cache_bytes if root.is_dir() else 0
    except InventoryError:
        return 0
