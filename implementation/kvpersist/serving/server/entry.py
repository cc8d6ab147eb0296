"""``lmcache server`` under kvpersist's policy: endpoints on Unix-domain sockets, lossless only.

LMCache 0.5.6 binds its request server to ``tcp://host:port`` and its admin API (uvicorn) to
``host:port``; its clients already accept ``ipc://`` URLs.  This entry point is the contained
server-side extension: it refuses a lossy ``serde`` in any ``--l2-adapter`` and, given the two
socket paths, changes *where* the two endpoints listen; then it runs LMCache's own command line
unchanged::

    python -m kvpersist.serving.server.entry [--request-socket P --http-socket P \\
        [--socket-mode 0600] [--socket-group G]] -- server <lmcache server arguments>

Invariants
----------
* An ``--l2-adapter`` whose ``serde`` is not lossless
  (:func:`kvpersist.config.adapters.refuse_lossy_serde`) stops the process before LMCache
  starts, with exit code 2 and the reason on stderr.
* No TCP listener is opened for either endpoint: the request server is built with
  ``ipc://<request socket>`` in place of the TCP URL, and uvicorn is handed a socket this
  module bound (``fd=``), never a host and port.
* Each socket file gets ``--socket-mode`` (and ``--socket-group``) before the server answers
  on it; the process umask is 0077, so everything else the server creates (L2 files, logs) is
  private to its account.  Access is decided by the runtime directory that holds the sockets
  (see :mod:`kvpersist.serving.server.private_paths`); the socket modes are a second line.
* Nothing here reads a ``KVP_FAULT_*`` variable: faults are installed only by the testing
  entry point :mod:`kvpersist.testing.fault_server`, which is not in the wheel.
* A socket path that exists is replaced only when it is a socket (a stale one of a dead server;
  the launcher has already proven no server runs); a symlink or any other file is refused.
* ``SIGUSR1`` writes every thread's Python stack to stderr (the server log) and the server goes
  on (:mod:`faulthandler`, registered before LMCache starts a thread).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...config.adapters import refuse_lossy_serde
from ...config.values import SettingsError
from ..lmcache_compat import pins, unix_endpoints
from . import cpu_priority


class SocketPathError(RuntimeError):
    """A socket path is occupied by something that is not a stale socket."""


def clear_stale_socket(path: Path) -> None:
    """Remove ``path`` when it is a socket nobody listens on; refuse a live socket, a symlink or
    any other file there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket"
        raise SocketPathError(f"{path} is {kind}; refusing to replace it (remove it yourself "
                              "if it is yours)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            pass  # ECONNREFUSED: nobody listens; the socket is stale
        else:
            raise SocketPathError(f"a live server listens on {path}; stop it first or use "
                                  "another KVP_RUNTIME_DIR")
    path.unlink()


def remove_socket(path: Path) -> None:
    """Unlink ``path`` if it is a socket (after its server was stopped: a process that inherited
    the listening socket may keep it open for a moment, so no probe here)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()


def _restrict(path: Path, mode: int, gid: int | None) -> None:
    if gid is not None:
        os.chown(path, -1, gid, follow_symlinks=False)
    os.chmod(path, mode)


def bind_http_socket(path: Path, mode: int, gid: int | None) -> socket.socket:
    """A listening AF_UNIX stream socket at ``path`` with ``mode``/``gid`` set."""
    clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    _restrict(path, mode, gid)
    sock.listen(128)
    return sock


def install(request_socket: Path, http_socket: Path, mode: int, gid: int | None) -> None:
    """Make LMCache's server listen on the two sockets (see the module invariants)."""
    listener = bind_http_socket(http_socket, mode, gid)
    unix_endpoints.install(request_socket, listener,
                           before_bind=lambda: clear_stale_socket(request_socket),
                           after_bind=lambda: _restrict(request_socket, mode, gid))


def parse_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600") from None
    if mode & ~0o660:
        raise argparse.ArgumentTypeError(f"{text!r}: a socket mode may grant owner and group "
                                         "read/write only (e.g. 0600 or 0660)")
    return mode


def adapter_arguments(lmcache_args: Sequence[str]) -> list[Any]:
    """The parsed JSON of every ``--l2-adapter`` value (a value that is not JSON is LMCache's
    to reject, and is returned as its text)."""
    values = []
    for i, arg in enumerate(lmcache_args):
        text = None
        if arg == "--l2-adapter" and i + 1 < len(lmcache_args):
            text = lmcache_args[i + 1]
        elif arg.startswith("--l2-adapter="):
            text = arg.split("=", 1)[1]
        if text is not None:
            try:
                values.append(json.loads(text))
            except ValueError:
                values.append(text)
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.serving.server.entry",
        description="Run `lmcache server` with its request (ZMQ) and admin (HTTP) endpoints on "
                    "Unix-domain sockets. Arguments after `--` are LMCache's own.")
    parser.add_argument("--request-socket", type=Path,
                        help="path of the ZMQ request socket (clients use ipc://PATH); "
                             "without it LMCache's TCP --host/--port apply")
    parser.add_argument("--http-socket", type=Path,
                        help="path of the admin API socket (curl --unix-socket PATH)")
    parser.add_argument("--socket-mode", type=parse_mode, default=0o600,
                        help="octal mode of both socket files (default 0600; 0660 with a group)")
    parser.add_argument("--socket-group", type=int, default=None,
                        help="gid given to both socket files")
    parser.add_argument("--nice", type=int, default=0,
                        help="the server's nice value, -20..19, set before LMCache starts a "
                             "thread (KVP_SERVER_NICE; see kvpersist.serving.server.cpu_priority)")
    parser.add_argument("--no-cpu-direct-copy", dest="cpu_direct_copy", action="store_false",
                        help="keep LMCache's own copy between L1 and a CPU engine's KV cache "
                             "(through its staging buffer) instead of kvpersist's one-pass copy "
                             "on a prefaulted mapping (KVP_CPU_DIRECT_COPY=false)")
    parser.add_argument("--restore-window-gb", type=float, default=None,
                        help="install kvpersist's L1 window (eviction of clean L1 objects on "
                             "demand, restores larger than L1 streamed in windows of this many "
                             "GB; 0: no streaming); without it LMCache's restore path is unchanged")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    split = args_in.index("--") if "--" in args_in else len(args_in)
    parser = build_parser()
    args = parser.parse_args(args_in[:split])
    lmcache_args = args_in[split + 1:]
    if (args.request_socket is None) != (args.http_socket is None):
        parser.error("--request-socket and --http-socket go together")
    os.umask(0o077)
    # `kill -USR1 <pid>`: every thread's stack to stderr (the server log), the server goes on
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    for line in pins.check_versions():  # the pins decide what is installed; this is a note
        print(f"kvpersist: {line}", file=sys.stderr, flush=True)
    try:
        cpu_priority.apply_nice(args.nice)
    except cpu_priority.PriorityError as exc:
        print(f"kvpersist: {exc}", file=sys.stderr)
        return 2
    try:
        for i, value in enumerate(adapter_arguments(lmcache_args)):
            refuse_lossy_serde(value, f"--l2-adapter #{i + 1}")
    except SettingsError as exc:
        print(f"kvpersist: {exc}", file=sys.stderr)
        return 2
    if args.restore_window_gb is not None:
        if args.restore_window_gb < 0:
            parser.error("--restore-window-gb must be 0 or positive")
        from ..lmcache_compat import l1_window
        from . import restore_metrics

        window = l1_window.install(int(args.restore_window_gb * 2**30))
        if window is not None:
            restore_metrics.bind(window.stats.snapshot)
    if args.cpu_direct_copy:
        from ..lmcache_compat import cpu_transfer

        cpu_transfer.install()
    from ..lmcache_compat import engine_release

    engine_release.install()
    if args.request_socket is not None:
        try:
            install(args.request_socket, args.http_socket, args.socket_mode, args.socket_group)
        except (SocketPathError, unix_endpoints.EndpointsError, OSError) as exc:
            print(f"kvpersist: cannot listen on {args.http_socket.parent}: {exc}",
                  file=sys.stderr)
            return 2
        print(f"kvpersist: LMCache endpoints on unix sockets {args.request_socket} (request) "
              f"and {args.http_socket} (admin), mode {args.socket_mode:04o}",
              file=sys.stderr, flush=True)
    from ..lmcache_compat import adapter_loading

    adapter_loading.install(lmcache_args, adapter_arguments(lmcache_args))
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(lmcache_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
