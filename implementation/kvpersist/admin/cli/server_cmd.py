"""``kvp-admin status`` and ``kvp-admin server start|stop|status``: the LMCache MP server's lifecycle
through its pid file and HTTP API."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from ...config.server import SettingsError, access_warning, describe_access
from ...serving.lmcache_compat.status import kvpersist_adapters
from ...serving.pidfile import PidFileError
from ...serving.server.lifecycle import (
    ServerError,
    exec_server,
    server_status,
    start_server,
    stop_server,
)
from .common import EXIT_ERROR, EXIT_OFF, EXIT_OK, Subparsers, add_json, print_json, settings_or_exit, table


def degraded_roots(server_status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The roots (devices) the server's kvpersist adapters have given up, with the reason."""
    return [d for a in kvpersist_adapters(server_status)
            for d in a.get("degraded_roots") or () if isinstance(d, Mapping)]


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    try:
        status = server_status(settings)
    except PidFileError as exc:
        print(f"kvp-admin status: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json(status)
    else:
        rows = [(k, v) for k, v in status.items() if k != "server_status"]
        rows += [("degraded L2 root", f"{d.get('root')}: {d.get('reason')}")
                 for d in degraded_roots(status.get("server_status") or {})]
        print(table(rows, ("item", "value")))
        if "server_status" in status:
            print("\nserver /status:")
            print(json.dumps(status["server_status"], indent=2, sort_keys=True, default=str))
    return EXIT_OK if status["healthy"] else EXIT_OFF


def cmd_server(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    try:
        if args.action == "start":
            res = start_server(settings)
            if res.warning:
                print(res.warning, file=sys.stderr)
            if res.replaced_stale is not None:
                print(f"note: replaced a {res.replaced_stale.state.value} pid file", file=sys.stderr)
            out = {"pid": res.pid, "seconds": round(res.seconds, 2), "access": settings.access,
                   "request_url": settings.request_url, "http_url": settings.http_url,
                   "cache_root": str(settings.cache_root)}
            if args.json:
                print_json(out)
            else:
                print(f"LMCache server started: pid {res.pid}, {describe_access(settings)}; "
                      f"root {settings.cache_root} ({res.seconds:.1f}s)")
            return EXIT_OK
        if args.action == "run":
            warning = access_warning(settings)
            if warning:
                print(warning, file=sys.stderr)
            print(f"kvp-server run: {describe_access(settings)}; root {settings.cache_root}",
                  file=sys.stderr, flush=True)
            exec_server(settings)
        if args.action == "stop":
            stopped = stop_server(settings)
            if args.json:
                print_json({"signalled": stopped.signalled, "graceful": stopped.graceful,
                             "state": stopped.status.state.value})
            else:
                print(stopped.describe(settings.pid_file))
            return EXIT_OK
        return cmd_status(args)
    except (ServerError, PidFileError, SettingsError) as exc:
        print(f"kvp-admin server {args.action}: {exc}", file=sys.stderr)
        return EXIT_ERROR


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "status",
        help="the LMCache server's pid, health, ports and /status (read over HTTP)",
        description="Read the pid file (never trusted blindly: a dead or reused pid is "
        "reported as stale) and the server's HTTP API. Exit 3 when the server is not healthy.",
    )
    add_json(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "server",
        help="start, stop or inspect the LMCache MP server for KVP_CACHE_ROOT",
        description="start: validate settings, check the root, runtime directory (or ports) and "
        "their modes, spawn the LMCache server in the background with telemetry off, write "
        "the pid file (in KVP_RUNTIME_DIR, default KVP_CACHE_ROOT/run) and wait for "
        "/healthcheck. run: the same checks, then "
        "become the server in the foreground (systemd Type=simple; output to stdout). stop: "
        "SIGTERM the recorded process (only if pid and start time match) and wait; SIGKILL "
        "after KVP_STOP_TIMEOUT_S.",
    )
    p.add_argument("action", choices=("start", "run", "stop", "status"))
    add_json(p)
    p.set_defaults(func=cmd_server)
