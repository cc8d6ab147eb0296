"""Lifecycle of the LMCache MP server: command line, start in the background, health, stop.

Invariants
----------
* Every setting is validated and every precondition checked (ports free, root writable, L1
  within the host's available memory)
  *before* a process is spawned; a failure raises :class:`ServerError` with a fix-it message.
* The server runs in its own session with telemetry off
  (:func:`kvpersist.config.environment.process_env`) and umask 0077; its output goes to
  ``KVP_CACHE_ROOT/lmcache-server.log``.
* With ``KVP_ACCESS=unix`` (the default) it listens only on the two sockets in the runtime
  directory (:mod:`kvpersist.serving.server.entry`); with ``tcp`` on ``KVP_BIND_HOST`` ports.
* The cache root, the runtime directory, the pid file and the log are private to the server's
  account (:mod:`kvpersist.serving.server.private_paths`): created so, and refused with a fix-it
  message when they are not.
* A background server writes its output into a pipe drained by its log relay
  (:mod:`kvpersist.serving.server.log_relay`): no server thread waits on the log's device.
* The pid file names one process by pid *and* start time; stop never signals a process
  that is not the recorded one (see :mod:`kvpersist.serving.pidfile`).
* ``start`` returns only once ``/healthcheck`` answers 200, or fails and leaves no process
  and no pid file behind.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ...config.adapters import l2_adapter_config
from ...config.environment import process_env
from ...config.paths import STATE_DIR_NAME
from ...config.server import NODES_DIR_NAME, ServerSettings, access_warning, node_part_names
from .. import http
from ..lmcache_compat.status import PATH as STATUS_PATH
from ..pidfile import (
    PidRecord,
    PidState,
    PidStatus,
    check_pid_file,
    process_start_ticks,
    remove_pid_file,
    wait_exited,
    write_pid_file,
)
from ..shm_sweep import sweep_python_segments, sweep_stale_segments
from .entry import SocketPathError, clear_stale_socket, remove_socket
from .host_memory import l1_refusal, mem_available_bytes
from .log_relay import Rotation, start_log_relay
from .private_paths import (
    PrivatePathError,
    check_private_file,
    ensure_private_dir,
    open_private_log,
)

HTTP_TIMEOUT_S = http.DEFAULT_TIMEOUT_S
#: How long stop (or a failed start) waits for the log relay to write the server's last lines.
RELAY_DRAIN_S = 5.0


class ServerError(RuntimeError):
    """Starting, stopping or reaching the server failed; the message says what to do."""


#: ``lmcache`` run by this interpreter under kvpersist's policy (lossless serdes only; the
#: endpoints on Unix-domain sockets unless KVP_ACCESS=tcp): the server imports the kvpersist
#: adapter from the same environment as the tool that starts it (an ``lmcache`` console script
#: on PATH could belong to another).
POLICY_ENTRY = ("-m", "kvpersist.serving.server.entry")


def lmcache_python() -> str:
    """This interpreter, once it is known to have LMCache (the server runs with it)."""
    if importlib.util.find_spec("lmcache") is None:
        raise ServerError(
            f"LMCache is not installed for {sys.executable}; install lmcache==0.5.6 there "
            "(in a checkout: scripts/bootstrap.sh)"
        )
    return sys.executable


def _entry(settings: ServerSettings, python: str | None,
           entry: Sequence[str] = POLICY_ENTRY) -> list[str]:
    cmd = [python or lmcache_python(), *entry,
           "--restore-window-gb", _num(settings.restore_window_gb)]
    if settings.server_nice:
        cmd += ["--nice", str(settings.server_nice)]
    if not settings.cpu_direct_copy:
        cmd += ["--no-cpu-direct-copy"]
    if settings.unix_sockets:
        group = settings.access_gid
        cmd += ["--request-socket", str(settings.request_socket),
                "--http-socket", str(settings.http_socket),
                "--socket-mode", "0660" if group is not None else "0600",
                *(["--socket-group", str(group)] if group is not None else [])]
    return [*cmd, "--"]


def server_command(settings: ServerSettings, python: str | None = None,
                   entry: Sequence[str] = POLICY_ENTRY) -> list[str]:
    """The server's argv for ``settings``: kvpersist's policy entry point (``entry``: the tests'
    fault-injecting one), then LMCache's own ``server`` arguments (pure; no I/O beyond the
    template file).  ``python``: the interpreter (default: this one, checked to have LMCache)."""
    return [
        *_entry(settings, python, entry),
        "server",
        "--host", settings.bind_host,
        "--port", str(settings.zmq_port),
        "--http-host", settings.bind_host,
        "--http-port", str(settings.http_port),
        "--chunk-size", str(settings.chunk_size),
        "--l1-size-gb", _num(settings.l1_size_gb),
        "--eviction-policy", "LRU",
        "--eviction-trigger-watermark", _num(settings.eviction_watermark),
        "--eviction-ratio", _num(settings.eviction_ratio),
        "--supported-transfer-mode", "auto",
        "--l2-adapter", json.dumps(l2_adapter_config(settings), separators=(",", ":")),
    ]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


#: numba's compiled-kernel cache, under the runtime directory (see :func:`server_environment`).
NUMBA_CACHE_NAME = "numba-cache"


def server_environment(base: Mapping[str, str] | None = None,
                       settings: ServerSettings | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: ours) with telemetry forced off.  The L2
    adapter is imported by the server from the installed ``kvpersist`` package.

    With ``settings``, numba caches its kernels in the runtime directory unless
    ``NUMBA_CACHE_DIR`` says otherwise: LMCache compiles kernels with numba's on-disk cache at
    import, and a service account can write neither the installed package (read-only under
    the unit's ``ProtectSystem=strict``) nor a home it does not have; without a writable cache
    LMCache's compute backend does not load ("CLI-only mode")."""
    env = process_env(base)
    if settings is not None and not env.get("NUMBA_CACHE_DIR"):
        env["NUMBA_CACHE_DIR"] = str(settings.socket_dir / NUMBA_CACHE_NAME)
    return env


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port (a TIME_WAIT leftover does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def prepare_cache_root(root: Path) -> None:
    """Create ``root`` with mode 0700 if needed, check it is private to this account, and prove
    it is a writable directory."""
    if root.exists() and not root.is_dir():
        raise ServerError(f"KVP_CACHE_ROOT={root} exists and is not a directory")
    try:
        ensure_private_dir(root, "KVP_CACHE_ROOT", allow_symlink=True)
    except PrivatePathError as exc:
        raise ServerError(str(exc)) from None
    except OSError as exc:
        raise ServerError(
            f"cannot create KVP_CACHE_ROOT={root}: {exc.strerror}; choose a writable path"
        ) from None
    # The probe goes to the root's state directory, made once: a file made and removed in the
    # root at every start would change the root's mtime and void the index snapshot.
    probe = root / STATE_DIR_NAME / f".kvp-write-probe.{os.getpid()}"
    try:
        probe.parent.mkdir(mode=0o700, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ServerError(
            f"KVP_CACHE_ROOT={root} is not writable ({exc.strerror}); fix its owner or mode"
        ) from None


def check_node_shares(settings: ServerSettings) -> None:
    """A shared tree holds at most ``KVP_SHARED_NODES`` node parts, this node's included: each
    part is capped at one share, so the tree stays within ``KVP_CACHE_BUDGET_GB`` only then.
    A retired node's part still holds files, so it still counts."""
    try:
        others = [n for n in node_part_names(settings.tree) if n != settings.node_id]
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ServerError(f"cannot list {settings.tree / NODES_DIR_NAME} ({exc.strerror}); is "
                          "the shared tree mounted?") from None
    if len(others) + 1 > settings.shared_nodes:
        raise ServerError(
            f"the shared tree {settings.tree} already has parts for {len(others)} other node(s) "
            f"({', '.join(others)}); with node {settings.node_id} that is more than "
            f"KVP_SHARED_NODES={settings.shared_nodes}, and the tree could exceed "
            "KVP_CACHE_BUDGET_GB. Raise KVP_SHARED_NODES on every node, or remove a retired "
            "node's part (kvp-admin tree shows which are live)")


def check_preconditions(settings: ServerSettings) -> PidStatus:
    """Everything ``start`` needs, checked before spawning.  Returns the pid-file status."""
    if settings.shared:
        check_node_shares(settings)
    prepare_cache_root(settings.cache_root)
    _ensure_runtime_dir(settings)  # it holds the pid file in either access mode
    try:
        check_private_file(settings.pid_file, "the pid file")
        check_private_file(settings.log_file, "the server log")
    except PrivatePathError as exc:
        raise ServerError(str(exc)) from None
    status = check_pid_file(settings.pid_file)
    if status.running and status.record is not None:
        raise ServerError(
            f"an LMCache server (pid {status.record.pid}) already runs on {settings.cache_root}; "
            "one server per cache root. Stop it first (scripts/kvp-server.sh stop)"
        )
    too_large = l1_refusal(settings, mem_available_bytes())
    if too_large is not None:
        raise ServerError(too_large)
    if settings.unix_sockets:
        _prepare_runtime_dir(settings)
        return status
    for name, port in (("KVP_ZMQ_PORT", settings.zmq_port), ("KVP_HTTP_PORT", settings.http_port)):
        if not port_is_free(settings.bind_host, port):
            raise ServerError(
                f"{name}={port} is busy on {settings.bind_host}; stop what uses it "
                f"(e.g. `ss -ltnp 'sport = :{port}'`) or choose another port"
            )
    return status


def _ensure_runtime_dir(settings: ServerSettings) -> None:
    """The private runtime directory (the pid file's and, with Unix sockets, the sockets')."""
    try:
        ensure_private_dir(settings.socket_dir, "KVP_RUNTIME_DIR", group=settings.access_gid)
    except PrivatePathError as exc:
        raise ServerError(str(exc)) from None
    except OSError as exc:
        raise ServerError(f"cannot create KVP_RUNTIME_DIR={settings.socket_dir}: "
                          f"{exc.strerror}; choose a writable path") from None


def _prepare_runtime_dir(settings: ServerSettings) -> None:
    """The private runtime directory, with no live server's socket and no stale one in it."""
    _ensure_runtime_dir(settings)
    if is_healthy(settings, timeout=1.0):
        raise ServerError(f"a server already answers on {settings.http_socket}; one server per "
                          "runtime directory. Stop it, or set another KVP_RUNTIME_DIR")
    try:
        for path in (settings.request_socket, settings.http_socket):
            clear_stale_socket(path)
    except SocketPathError as exc:
        raise ServerError(str(exc)) from None


def is_healthy(settings: ServerSettings, timeout: float = HTTP_TIMEOUT_S) -> bool:
    return http.answers(settings.http_url + "/healthcheck", timeout=timeout)


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass(frozen=True)
class StartResult:
    pid: int
    replaced_stale: PidStatus | None
    warning: str | None
    seconds: float


def _prepare_start(settings: ServerSettings) -> PidStatus | None:
    """Every precondition checked; a stale pid file (dead or reused pid) removed and returned."""
    previous = check_preconditions(settings)
    stale = previous if previous.state in (PidState.DEAD, PidState.REUSED) else None
    if stale is not None:
        remove_pid_file(settings.pid_file, stale.record)
    return stale


def _pid_record(pid: int, settings: ServerSettings, log_relay_pid: int = 0) -> PidRecord:
    return PidRecord(pid, process_start_ticks(pid) or 0, "lmcache server", settings.zmq_port,
                     settings.http_port, log_relay_pid, settings.node_id or "")


def start_server(settings: ServerSettings, *, env: Mapping[str, str] | None = None,
                 entry: Sequence[str] = POLICY_ENTRY) -> StartResult:
    """Start the server in the background and wait for ``/healthcheck``.  Its output reaches
    the log through a relay (:mod:`kvpersist.serving.server.log_relay`), so the server never waits on
    the log's device."""
    stale = _prepare_start(settings)
    sweep_stale_segments()  # what earlier CPU lmcache_driven runs left in /dev/shm
    sweep_python_segments()  # vLLM's message queues of runs killed long ago
    cmd = server_command(settings, entry=entry)
    began = time.monotonic()
    log = open_private_log(settings.log_file)
    try:
        relay = start_log_relay(log, rotation=Rotation(
            settings.log_file, settings.log_max_mb * 2**20, settings.log_backups))
    finally:
        os.close(log)
    try:
        proc = subprocess.Popen(
            cmd,
            env=server_environment(env, settings),
            stdin=subprocess.DEVNULL,
            stdout=relay.write_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=settings.cache_root,
            umask=0o077,
        )
    finally:
        relay.release()
    record = _pid_record(proc.pid, settings, relay.pid)
    write_pid_file(settings.pid_file, record)
    deadline = began + settings.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            remove_pid_file(settings.pid_file, record)
            relay.drained(RELAY_DRAIN_S)
            raise ServerError(
                f"the LMCache server exited with code {proc.returncode} during start; "
                f"log {settings.log_file}:\n{_log_tail(settings.log_file)}"
            )
        if is_healthy(settings, timeout=1.0):
            return StartResult(proc.pid, stale, access_warning(settings), time.monotonic() - began)
        time.sleep(0.25)
    _terminate(proc.pid, settings.stop_timeout_s)
    with contextlib.suppress(ChildProcessError):
        proc.wait(timeout=1)
    remove_pid_file(settings.pid_file, record)
    relay.drained(RELAY_DRAIN_S)
    raise ServerError(
        f"the LMCache server did not become healthy within {settings.start_timeout_s:.0f}s "
        f"(KVP_START_TIMEOUT_S); log {settings.log_file}:\n{_log_tail(settings.log_file)}"
    )


def exec_server(settings: ServerSettings, *, env: Mapping[str, str] | None = None) -> NoReturn:
    """Become the server, in the foreground (``kvp-server run``, for systemd's ``Type=simple``).

    The same checks as :func:`start_server`; the pid file names this process, which keeps its pid
    and start time across the ``exec``, so ``kvp-server status/stop`` and ``kvp-admin`` see it as
    usual.  Output goes to this process's stdout/stderr (the journal under systemd)."""
    _prepare_start(settings)
    cmd = server_command(settings)
    record = _pid_record(os.getpid(), settings)
    write_pid_file(settings.pid_file, record)
    os.umask(0o077)
    try:
        os.chdir(settings.cache_root)
        os.execve(cmd[0], cmd, server_environment(env, settings))
    except OSError as exc:
        remove_pid_file(settings.pid_file, record)
        raise ServerError(f"cannot run {cmd[0]}: {exc.strerror}") from None


def _terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL.  True if it stopped on SIGTERM."""
    ticks = process_start_ticks(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if wait_exited(pid, timeout_s, ticks=ticks, interval_s=0.1):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_exited(pid, 5.0, ticks=ticks, interval_s=0.1)
    return False


@dataclass(frozen=True)
class StopResult:
    status: PidStatus
    signalled: bool
    graceful: bool

    def describe(self, path: Path) -> str:
        if not self.signalled:
            if self.status.state is PidState.ABSENT:
                return f"not running (no pid file at {path})"
            return f"not signalled: {self.status.describe(path)}; removed the stale pid file"
        how = "stopped on SIGTERM" if self.graceful else "did not stop on SIGTERM; killed"
        assert self.status.record is not None
        return f"LMCache server pid {self.status.record.pid} {how}"


def stop_server(settings: ServerSettings) -> StopResult:
    """Stop the recorded server with SIGTERM (SIGKILL after ``KVP_STOP_TIMEOUT_S``).

    A stale pid file is reported and removed; its pid is never signalled.
    """
    status = check_pid_file(settings.pid_file)
    if not status.running:
        if status.record is not None:
            remove_pid_file(settings.pid_file, status.record)
        return StopResult(status, signalled=False, graceful=False)
    assert status.record is not None
    graceful = _terminate(status.record.pid, settings.stop_timeout_s)
    if status.record.log_relay_pid:  # the server's last lines are in the log on return
        wait_exited(status.record.log_relay_pid, RELAY_DRAIN_S)
    remove_pid_file(settings.pid_file, status.record)
    if settings.unix_sockets:  # the recorded server is gone: its socket files go too
        for path in (settings.request_socket, settings.http_socket):
            with contextlib.suppress(OSError):
                remove_socket(path)
    sweep_stale_segments()  # segments of vLLM workers that are gone (the server mapped them)
    return StopResult(status, signalled=True, graceful=graceful)


def server_status(settings: ServerSettings) -> dict[str, Any]:
    """Pid-file state, health and the server's ``/status`` (when it answers)."""
    pid = check_pid_file(settings.pid_file)
    out: dict[str, Any] = {
        "cache_root": str(settings.cache_root),
        "pid_file": str(settings.pid_file),
        "pid": pid.record.pid if pid.record else None,
        "pid_state": pid.state.value,
        "access": settings.access,
        "request_url": settings.request_url,
        "bind_host": settings.bind_host,
        "zmq_port": settings.zmq_port,
        "http_port": settings.http_port,
        "http_url": settings.http_url,
        "l2_adapter": settings.l2_adapter,
        "healthy": is_healthy(settings),
    }
    if out["healthy"]:
        try:
            resp = http.get(settings.http_url + STATUS_PATH)
            out["server_status"] = resp.json() if resp.ok else {"http_status": resp.status}
        except (http.HttpError, ValueError) as exc:
            out["server_status"] = {"error": str(exc)}
    return out
