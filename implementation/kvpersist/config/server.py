"""Settings of the LMCache MP server with a kvpersist L2 tier: defaults, the template file and the
environment, validated up front.

Invariants
----------
* Every value is validated before anything starts; a bad value raises :class:`SettingsError`
  whose message names the variable, the bad value and what is expected.
* Precedence: explicit overrides > process environment > the site configuration file
  (:mod:`kvpersist.config.site`) > the registry's defaults (:mod:`kvpersist.config.registry`).
  The same precedence serves the launcher, ``kvp-admin``, the demo and the tests.
* Access is ``unix`` unless ``KVP_ACCESS`` says otherwise: the request (ZMQ) and admin (HTTP)
  endpoints are Unix-domain sockets in ``KVP_RUNTIME_DIR`` (default ``<KVP_CACHE_ROOT>/run``), a
  directory only the server's account (and ``KVP_ACCESS_GROUP``, when set) may enter.  ``tcp``
  is the explicit opt-in to the unauthenticated loopback ports, reported by
  :func:`access_warning`.
* With ``KVP_ACCESS=tcp`` servers bind 127.0.0.1 unless ``KVP_BIND_HOST`` says otherwise; a
  non-loopback bind is allowed but reported by :func:`access_warning`.
"""

from __future__ import annotations

import grp
import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import values
from .adapters import known_adapters
from .admin import WALKERS
from .registry import defaults
from .site import effective_environ
from .values import SettingsError as SettingsError

#: The server's settings (its adapter's included) and their defaults, from the registry.
DEFAULTS: dict[str, str] = defaults("server", "adapter")

#: ``unix``: sockets in a private directory (the default); ``tcp``: open loopback ports (opt-in).
ACCESS_MODES = ("unix", "tcp")
#: sun_path holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
RUNTIME_DIR_NAME = "run"
REQUEST_SOCKET_NAME = "request.sock"
HTTP_SOCKET_NAME = "http.sock"

PID_FILE_NAME = "lmcache-server.pid"
LOG_FILE_NAME = "lmcache-server.log"
#: In a shared tree, node ``<id>`` keeps its files under ``<KVP_CACHE_ROOT>/nodes/<id>``.
NODES_DIR_NAME = "nodes"
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def node_part_names(tree: Path) -> list[str]:
    """The node ids with a part in the shared ``tree`` (its directories under ``nodes/``,
    symlinks not followed), sorted.  The one listing of a tree's parts (start check, the
    shared-tree reader, ``kvp-admin``); OSError when it cannot be listed."""
    with os.scandir(tree / NODES_DIR_NAME) as entries:
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))


#: ``KVP_RESTORE_WINDOW_GB=auto``: an eighth of L1, at most this many GB.
AUTO_WINDOW_MAX_GB = 2.0


def _nice(raw: str) -> int:
    """``KVP_SERVER_NICE``: a nice value, -20 (first) to 19 (last); 0 leaves it as inherited."""
    value = values.integer("KVP_SERVER_NICE", raw, minimum=-20)
    if value > 19:
        raise SettingsError(f"KVP_SERVER_NICE={raw!r} must be at most 19 (nice values are "
                            "-20..19; negative ones run the server ahead of vLLM's workers)")
    return value


def restore_window_gb(raw: str, l1_size_gb: float) -> float:
    """``KVP_RESTORE_WINDOW_GB``: ``auto`` (an eighth of L1, at most 2 GB), ``0`` (off) or a
    size that leaves room for two windows in L1 (:mod:`kvpersist.serving.restore_window`)."""
    text = raw.strip().lower()
    if text == "auto":
        return min(AUTO_WINDOW_MAX_GB, l1_size_gb / 8)
    value = values.number("KVP_RESTORE_WINDOW_GB", raw)
    if value == 0:
        return 0.0
    if not 0 < value <= l1_size_gb / 2:
        raise SettingsError(f"KVP_RESTORE_WINDOW_GB={raw!r} must be auto, 0 (no streaming) or a "
                            f"size of at most half of KVP_L1_SIZE_GB ({l1_size_gb:g} GB): a "
                            "streamed restore holds two windows in L1")
    return value


@dataclass(frozen=True)
class ServerSettings:
    """Validated settings of one LMCache MP server with a kvpersist L2 tier."""

    cache_root: Path
    l1_size_gb: float
    budget_gb: float
    bind_host: str
    zmq_port: int
    http_port: int
    l2_adapter: str
    l2_sharded: bool
    eviction_watermark: float
    eviction_ratio: float
    chunk_size: int
    start_timeout_s: float
    stop_timeout_s: float
    access: str = "unix"
    runtime_dir: Path | None = None
    access_group: str | None = None
    l2_serde: Mapping[str, Any] | None = None
    node_id: str | None = None
    shared_nodes: int = 1
    walker: str = "auto"  # the start-up scan's walker (auto: C when built)
    walk_threads: int = 0  # its stat threads (0: one per CPU, at most 8)
    l2_direct_io: bool = True  # O_DIRECT payload reads (kvpersist adapter)
    scan_snapshot: bool = True  # a clean stop leaves an index snapshot for the next start
    #: ``KVP_CACHE_ROOT`` as given: the tree every node mounts (equal to ``cache_root`` unless
    #: ``node_id`` is set, where ``cache_root`` is this node's part of it).
    tree_root: Path | None = None
    #: L2 bytes one streamed restore loads into L1 per step (0: restores do not stream).
    restore_window_gb: float = 0.0
    #: One-pass copies between L1 and a CPU engine's KV cache (lmcache_compat.cpu_transfer).
    cpu_direct_copy: bool = True
    #: The server's nice value (0: inherited); :mod:`kvpersist.serving.server.cpu_priority`.
    server_nice: int = 0
    #: The background server's log is rotated at this size, keeping this many old files.
    log_max_mb: int = 100
    log_backups: int = 3
    #: kvpersist's adapter: fsync before publish, task and file parallelism, quarantine cap.
    l2_fsync: bool = False
    l2_io_threads: int = 4
    l2_file_threads: int = 16
    l2_quarantine_max_files: int = 1024
    #: More L2 roots, one per device (``KVP_CACHE_EXTRA_ROOTS``), resolved like the root.
    extra_roots: tuple[Path, ...] = ()

    @property
    def l2_roots(self) -> tuple[Path, ...]:
        """Every root of the L2 tier: ``cache_root`` first, then ``KVP_CACHE_EXTRA_ROOTS``."""
        return (self.cache_root, *self.extra_roots)

    @property
    def shared(self) -> bool:
        """Several nodes share the tree (``KVP_NODE_ID`` is set)."""
        return self.node_id is not None

    @property
    def tree(self) -> Path:
        return self.tree_root or self.cache_root

    @property
    def node_budget_gb(self) -> float:
        """This node's hard cap: its equal share of the tree's budget."""
        return self.budget_gb / self.shared_nodes

    @property
    def unix_sockets(self) -> bool:
        return self.access == "unix"

    @property
    def access_gid(self) -> int | None:
        """The gid of ``KVP_ACCESS_GROUP`` (checked when the settings were loaded), or None."""
        return None if self.access_group is None else group_id(self.access_group)

    @property
    def socket_dir(self) -> Path:
        """The runtime directory that holds the sockets (``KVP_RUNTIME_DIR``)."""
        return self.runtime_dir or self.cache_root / RUNTIME_DIR_NAME

    @property
    def request_socket(self) -> Path:
        return self.socket_dir / REQUEST_SOCKET_NAME

    @property
    def http_socket(self) -> Path:
        return self.socket_dir / HTTP_SOCKET_NAME

    @property
    def request_url(self) -> str:
        """The URL a ZMQ client connects to (``lmcache.mp.server_urls``)."""
        if self.unix_sockets:
            return f"ipc://{self.request_socket}"
        return f"{self.zmq_url}:{self.zmq_port}"

    @property
    def node_state_dir(self) -> Path:
        """Where the log lives: the cache root, or on a shared tree the node's local runtime
        directory (another node must never read this node's log as its own)."""
        return self.socket_dir if self.shared else self.cache_root

    @property
    def pid_file(self) -> Path:
        """In the runtime directory, never in the cache root: writing and removing it at every
        start and stop would change the root's mtime, which tells the next start whether the
        index snapshot still describes the tree (:mod:`kvpersist.l2.snapshot`)."""
        return self.socket_dir / PID_FILE_NAME

    @property
    def log_file(self) -> Path:
        return self.node_state_dir / LOG_FILE_NAME

    @property
    def http_url(self) -> str:
        """The admin API's base URL: ``http+unix://<quoted socket path>`` or ``http://host:port``
        (:mod:`kvpersist.serving.http` speaks both)."""
        if self.unix_sockets:
            return "http+unix://" + urllib.parse.quote(str(self.http_socket), safe="")
        host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "localhost") else self.bind_host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.http_port}"

    @property
    def zmq_url(self) -> str:
        host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "localhost") else self.bind_host
        return f"tcp://{host}"


def load_settings(
    overrides: Mapping[str, str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ServerSettings:
    """Resolve and validate settings (see the module docstring for precedence)."""
    merged: dict[str, str] = dict(DEFAULTS)
    env = effective_environ(environ)
    merged.update({k: env[k] for k in DEFAULTS if k in env and env[k] != ""})
    if overrides:
        unknown = sorted(set(overrides) - set(DEFAULTS))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        merged.update(overrides)
    adapter = merged["KVP_L2_ADAPTER"].strip()
    if adapter not in known_adapters():
        raise SettingsError(
            f"KVP_L2_ADAPTER={adapter!r} is not known; choose one of {', '.join(known_adapters())}"
        )
    root_raw = merged["KVP_CACHE_ROOT"].strip()
    if not root_raw:
        raise SettingsError("KVP_CACHE_ROOT is empty; set it to a directory on the NVMe tier")
    # Resolved once, here: every command (server, scan, admin, clients) sees the same real
    # directory, so a symlinked root works everywhere instead of failing the scan's O_NOFOLLOW.
    tree = Path(root_raw).expanduser().resolve()
    node_id = _node_id(merged["KVP_NODE_ID"])
    settings = ServerSettings(
        cache_root=tree if node_id is None else tree / NODES_DIR_NAME / node_id,
        l1_size_gb=values.positive_float("KVP_L1_SIZE_GB", merged["KVP_L1_SIZE_GB"]),
        budget_gb=values.positive_float("KVP_CACHE_BUDGET_GB", merged["KVP_CACHE_BUDGET_GB"]),
        bind_host=values.host("KVP_BIND_HOST", merged["KVP_BIND_HOST"]),
        zmq_port=values.port("KVP_ZMQ_PORT", merged["KVP_ZMQ_PORT"]),
        http_port=values.port("KVP_HTTP_PORT", merged["KVP_HTTP_PORT"]),
        l2_adapter=adapter,
        l2_sharded=values.boolean("KVP_L2_SHARDED", merged["KVP_L2_SHARDED"]),
        walker=values.choice("KVP_WALKER", merged["KVP_WALKER"], WALKERS),
        walk_threads=values.integer("KVP_WALK_THREADS", merged["KVP_WALK_THREADS"], minimum=0),
        l2_direct_io=values.boolean("KVP_L2_DIRECT_IO", merged["KVP_L2_DIRECT_IO"]),
        scan_snapshot=values.boolean("KVP_SCAN_SNAPSHOT", merged["KVP_SCAN_SNAPSHOT"]),
        eviction_watermark=values.fraction("KVP_EVICTION_WATERMARK", merged["KVP_EVICTION_WATERMARK"]),
        eviction_ratio=values.fraction("KVP_EVICTION_RATIO", merged["KVP_EVICTION_RATIO"]),
        chunk_size=values.positive_int("KVP_CHUNK_SIZE", merged["KVP_CHUNK_SIZE"]),
        start_timeout_s=values.positive_float("KVP_START_TIMEOUT_S", merged["KVP_START_TIMEOUT_S"]),
        stop_timeout_s=values.positive_float("KVP_STOP_TIMEOUT_S", merged["KVP_STOP_TIMEOUT_S"]),
        access=values.choice("KVP_ACCESS", merged["KVP_ACCESS"], ACCESS_MODES),
        runtime_dir=(Path(merged["KVP_RUNTIME_DIR"].strip()).expanduser().absolute()
                     if merged["KVP_RUNTIME_DIR"].strip() else None),
        access_group=merged["KVP_ACCESS_GROUP"].strip() or None,
        l2_serde=_serde("KVP_L2_SERDE", merged["KVP_L2_SERDE"]),
        node_id=node_id,
        shared_nodes=values.positive_int("KVP_SHARED_NODES", merged["KVP_SHARED_NODES"]),
        restore_window_gb=restore_window_gb(merged["KVP_RESTORE_WINDOW_GB"],
                                            values.positive_float("KVP_L1_SIZE_GB",
                                                                  merged["KVP_L1_SIZE_GB"])),
        tree_root=tree,
        server_nice=_nice(merged["KVP_SERVER_NICE"]),
        cpu_direct_copy=values.boolean("KVP_CPU_DIRECT_COPY", merged["KVP_CPU_DIRECT_COPY"]),
        log_max_mb=values.positive_int("KVP_LOG_MAX_MB", merged["KVP_LOG_MAX_MB"]),
        log_backups=values.integer("KVP_LOG_BACKUPS", merged["KVP_LOG_BACKUPS"], minimum=0),
        l2_fsync=values.boolean("KVP_L2_FSYNC", merged["KVP_L2_FSYNC"]),
        l2_io_threads=values.positive_int("KVP_L2_IO_THREADS", merged["KVP_L2_IO_THREADS"]),
        l2_file_threads=values.positive_int("KVP_L2_FILE_THREADS",
                                            merged["KVP_L2_FILE_THREADS"]),
        l2_quarantine_max_files=values.positive_int("KVP_L2_QUARANTINE_MAX_FILES",
                                                    merged["KVP_L2_QUARANTINE_MAX_FILES"]),
        extra_roots=extra_roots(merged["KVP_CACHE_EXTRA_ROOTS"], tree),
    )
    _check_sizes(settings)
    _check_shared(settings)
    _check_access(settings)
    if settings.zmq_port == settings.http_port:
        raise SettingsError(
            f"KVP_ZMQ_PORT and KVP_HTTP_PORT are both {settings.zmq_port}; they must differ"
        )
    return settings


def extra_roots(raw: str, root: Path) -> tuple[Path, ...]:
    """``KVP_CACHE_EXTRA_ROOTS``: absolute directories separated by ``:``, resolved once like
    ``KVP_CACHE_ROOT``; none may repeat, hold or lie inside another root."""
    parts = [p.strip() for p in raw.split(":") if p.strip()]
    roots: list[Path] = []
    for part in parts:
        path = Path(part).expanduser()
        if not path.is_absolute():
            raise SettingsError(f"KVP_CACHE_EXTRA_ROOTS: {part!r} is not an absolute path")
        roots.append(path.resolve())
    every = [root, *roots]
    for i, a in enumerate(every):
        for b in every[i + 1:]:
            if a == b or _within(a, b) or _within(b, a):
                raise SettingsError(
                    f"KVP_CACHE_EXTRA_ROOTS: {b} and {a} overlap; give each root its own "
                    "directory, one per device")
    return tuple(roots)


def _node_id(raw: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    if not _NODE_ID.fullmatch(value):
        raise SettingsError(f"KVP_NODE_ID={value!r} is not a node id: 1-64 letters, digits, '.', "
                            "'_' or '-', starting with a letter or digit (e.g. the host name)")
    return value


#: The smallest budget a node's L2 may get: one chunk of a small model is about 1 MiB; less is a
#: typo (a unit), not a cache.
MIN_NODE_BUDGET_BYTES = 1 << 20
#: The smallest L1: LMCache allocates it in full at start; less holds no chunk.
MIN_L1_BYTES = 1 << 20


def _check_sizes(settings: ServerSettings) -> None:
    """Sizes that make no sense are refused at start, naming the variable."""
    node_bytes = settings.node_budget_gb * 2**30
    if node_bytes < MIN_NODE_BUDGET_BYTES:
        share = (f" shared by {settings.shared_nodes} nodes" if settings.shared_nodes > 1
                 else "")
        raise SettingsError(
            f"KVP_CACHE_BUDGET_GB={settings.budget_gb:g}{share} gives a node {node_bytes:.0f} "
            f"bytes of L2; at least {MIN_NODE_BUDGET_BYTES} (0.001 GB) per node")
    if settings.l1_size_gb * 2**30 < MIN_L1_BYTES:
        raise SettingsError(f"KVP_L1_SIZE_GB={settings.l1_size_gb:g} holds no chunk; at least "
                            "0.001 GB")


def _check_shared(settings: ServerSettings) -> None:
    if settings.extra_roots and (settings.shared or settings.l2_adapter != "kvpersist"):
        raise SettingsError("KVP_CACHE_EXTRA_ROOTS needs KVP_L2_ADAPTER=kvpersist and no "
                            "KVP_NODE_ID (a shared tree is one directory per node)")
    if not settings.shared:
        if settings.shared_nodes != 1:
            raise SettingsError(f"KVP_SHARED_NODES={settings.shared_nodes} needs KVP_NODE_ID: "
                                "give each node of the shared tree its own id")
        return
    if settings.l2_adapter != "kvpersist":
        raise SettingsError(f"KVP_NODE_ID (a shared tree) needs KVP_L2_ADAPTER=kvpersist, not "
                            f"{settings.l2_adapter!r}: only it keeps per-node parts and "
                            "verifies what other nodes wrote")
    runtime = settings.runtime_dir
    if runtime is None or _within(runtime, settings.tree):
        raise SettingsError(
            "KVP_NODE_ID (a shared tree) needs KVP_RUNTIME_DIR on the node's local disk, outside "
            f"KVP_CACHE_ROOT={settings.tree}: the sockets, the pid file and the log belong to "
            "one node (e.g. KVP_RUNTIME_DIR=/run/kvpersist)")


def _within(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or below it (both absolute, as settings hold them)."""
    return path == root or root in path.parents


def _serde(name: str, raw: str) -> dict[str, Any] | None:
    """``KVP_L2_SERDE``: a JSON object such as ``{"type": "aesgcm", "master_key_path": ...}``
    (checked to be lossless by :func:`kvpersist.config.adapters.refuse_lossy_serde`)."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not JSON; e.g. "
                            '{"type": "aesgcm", "master_key_path": "/etc/kvpersist/master.key"}'
                            ) from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise SettingsError(f"{name}={raw!r} must be a JSON object with a \"type\"")
    return value


def group_id(name: str) -> int:
    """The gid of group ``name`` (a name or a number), or :class:`SettingsError`."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise SettingsError(f"KVP_ACCESS_GROUP={name!r} is not a group on this host "
                            "(see `getent group`)") from None


def _check_access(settings: ServerSettings) -> None:
    if not settings.unix_sockets:
        if settings.access_group is not None:
            raise SettingsError("KVP_ACCESS_GROUP applies to KVP_ACCESS=unix only; the tcp "
                                "endpoints cannot tell accounts apart")
        return
    if settings.access_gid is not None:
        runtime = settings.socket_dir
        if _within(runtime, settings.cache_root):
            raise SettingsError(
                "KVP_ACCESS_GROUP needs KVP_RUNTIME_DIR outside KVP_CACHE_ROOT (the cache root "
                "stays 0700, so the group could not reach sockets inside it); e.g. "
                "KVP_RUNTIME_DIR=/run/kvpersist")
    for path in (settings.request_socket, settings.http_socket):
        if len(os.fsencode(str(path))) > MAX_SOCKET_PATH_BYTES:
            raise SettingsError(
                f"the socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes, the limit "
                "of a Unix-domain socket; set KVP_RUNTIME_DIR to a shorter directory "
                "(e.g. /run/kvpersist)")


def access_warning(settings: ServerSettings) -> str | None:
    """A warning text when the endpoints are not limited to the server's account, else None."""
    if settings.unix_sockets:
        return None
    where = ("loopback" if values.is_loopback(settings.bind_host)
             else f"{settings.bind_host}, which is not loopback")
    return (
        f"WARNING: KVP_ACCESS=tcp: the LMCache server listens on {where} (ports "
        f"{settings.zmq_port}, {settings.http_port}) without access control: any account on "
        "this host (and any container sharing its network) can read, write and delete the "
        "cache. Use the default KVP_ACCESS=unix unless every local account is trusted"
    )


def describe_access(settings: ServerSettings) -> str:
    """One line for operators: which access mode is on and who may use the endpoints."""
    if settings.unix_sockets:
        who = "the server's account" + (f" and group {settings.access_group}"
                                         if settings.access_group else "")
        return (f"unix sockets in {settings.socket_dir} (request {REQUEST_SOCKET_NAME}, admin "
                f"{HTTP_SOCKET_NAME}); only {who} may connect")
    return (f"tcp {settings.bind_host}:{settings.zmq_port} (request) and "
            f":{settings.http_port} (admin), open to every local account")
