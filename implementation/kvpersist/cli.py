"""``kvp-admin``: the operator's tool (also ``python3 -m kvpersist.cli``).

Invariants: every subcommand has ``--help`` and ``--json``; nothing here starts by itself,
and nothing deletes cache data.  Exit codes: 0 ok, 1 error, 2 usage, 3 "caching off"
(identity incomplete or contradicted) or "server not healthy".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .identity import (
    FIELDS,
    IdentityError,
    IdentityResolution,
    diff_identities,
    load_pins,
    merge_sources,
)
from .identity_sources import CONNECTOR_NAME, build_identity, from_model_folder
from .pidfile import PidFileError
from .server import ServerError, server_status, start_server, stop_server
from .settings import SettingsError, load_settings

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_OFF = 0, 1, 2, 3


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def _table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------- identity


def resolve_cli_identity(args: argparse.Namespace) -> tuple[IdentityResolution, dict[str, object]]:
    """Pins (``--pins``) checked against what the model folder and flags say."""
    pins: dict[str, object] = dict(load_pins(args.pins)) if args.pins else {}
    live: dict[str, object] = {}
    if args.model_folder:
        live.update(from_model_folder(args.model_folder, kv_cache_dtype=args.kv_cache_dtype))
    for name, value in (
        ("block_size", args.block_size),
        ("tensor_parallel_size", args.tensor_parallel_size),
        ("pipeline_parallel_size", args.pipeline_parallel_size),
        ("max_model_len", args.max_model_len),
    ):
        if value is not None:
            live[name] = value
    if args.model_folder or args.with_build:
        live["connector"] = CONNECTOR_NAME
        build = build_identity()
        if build is not None:
            live["build"] = build
    return merge_sources(pins, live, live_label="resolved"), pins


def cmd_identity(args: argparse.Namespace) -> int:
    if args.diff:
        return cmd_identity_diff(args)
    try:
        resolution, pins = resolve_cli_identity(args)
    except (IdentityError, ValueError) as exc:
        print(f"kvp-admin identity: {exc}", file=sys.stderr)
        return EXIT_ERROR
    ident = resolution.identity
    if args.json:
        _print_json({
            "enabled": resolution.enabled,
            "namespace": ident.namespace if ident else None,
            "lmcache_model_name": ident.lmcache_model_name() if ident else None,
            "fields": ident.as_dict() if ident else None,
            "sources": resolution.sources,
            "problems": resolution.problems,
        })
    else:
        rows = [
            (s.name, getattr(ident, s.name) if ident else pins.get(s.name, "?"),
             resolution.sources.get(s.name, "-"))
            for s in FIELDS
        ]
        print(_table(rows, ("field", "value", "source")))
        print()
        print(resolution.summary())
        if ident:
            print(f"lmcache model name: {ident.lmcache_model_name()}")
    return EXIT_OK if resolution.enabled else EXIT_OFF


def _load_side(spec: str) -> dict[str, object]:
    path = Path(spec)
    if path.is_dir():
        return dict(from_model_folder(path))
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return dict(data.get("fields", data))
    return dict(load_pins(path))


def cmd_identity_diff(args: argparse.Namespace) -> int:
    a_spec, b_spec = args.diff
    try:
        a, b = _load_side(a_spec), _load_side(b_spec)
    except (IdentityError, ValueError, OSError) as exc:
        print(f"kvp-admin identity --diff: {exc}", file=sys.stderr)
        return EXIT_ERROR
    diffs = diff_identities(a, b)
    if args.json:
        _print_json({"same": not diffs, "differences": [
            {"field": f, "a": va, "b": vb} for f, va, vb in diffs]})
    elif not diffs:
        print("same identity fields: these configurations share KV (same namespace)")
    else:
        print(f"{len(diffs)} field(s) differ, so the two configurations never share KV:")
        print(_table([(f, va, vb) for f, va, vb in diffs], ("field", a_spec, b_spec)))
    return EXIT_OK


# ------------------------------------------------------------------------- server


def _settings_or_exit() -> Any:
    try:
        return load_settings()
    except SettingsError as exc:
        print(f"kvp-admin: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    try:
        status = server_status(settings)
    except PidFileError as exc:
        print(f"kvp-admin status: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        _print_json(status)
    else:
        rows = [(k, v) for k, v in status.items() if k != "server_status"]
        print(_table(rows, ("item", "value")))
        if "server_status" in status:
            print("\nserver /status:")
            print(json.dumps(status["server_status"], indent=2, sort_keys=True, default=str))
    return EXIT_OK if status["healthy"] else EXIT_OFF


def cmd_server(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    try:
        if args.action == "start":
            res = start_server(settings)
            if res.warning:
                print(res.warning, file=sys.stderr)
            if res.replaced_stale is not None:
                print(f"note: replaced a {res.replaced_stale.state.value} pid file", file=sys.stderr)
            out = {"pid": res.pid, "seconds": round(res.seconds, 2), "http_url": settings.http_url,
                   "zmq_port": settings.zmq_port, "cache_root": str(settings.cache_root)}
            if args.json:
                _print_json(out)
            else:
                print(f"LMCache server started: pid {res.pid}, ZMQ {settings.zmq_url}:"
                      f"{settings.zmq_port}, HTTP {settings.http_url}, root {settings.cache_root} "
                      f"({res.seconds:.1f}s)")
            return EXIT_OK
        if args.action == "stop":
            stopped = stop_server(settings)
            if args.json:
                _print_json({"signalled": stopped.signalled, "graceful": stopped.graceful,
                             "state": stopped.status.state.value})
            else:
                print(stopped.describe(settings.pid_file))
            return EXIT_OK
        return cmd_status(args)
    except (ServerError, PidFileError, SettingsError) as exc:
        print(f"kvp-admin server {args.action}: {exc}", file=sys.stderr)
        return EXIT_ERROR


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvp-admin",
        description="Operate the kvpersist KV-cache tier: identities, the LMCache server, status. "
        "Settings come from configs/generic/lmcache-server.env overridden by the environment "
        "(KVP_CACHE_ROOT, KVP_L1_SIZE_GB, KVP_CACHE_BUDGET_GB, KVP_ZMQ_PORT, KVP_HTTP_PORT, ...).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "identity",
        help="resolve the compatibility identity and namespace; explain why two configs differ",
        description="Resolve the cache identity of a model folder and/or a pins file "
        "(configs/<model>/identity.env). Fields found in both must agree, or caching is OFF "
        "(exit 3) and the disagreeing field is named. Example: kvp-admin identity --pins "
        "configs/tiny-llama/identity.env --model-folder /models/.../snapshots/<sha>. "
        "With --diff A B (pins files, model folders or 'identity --json' outputs) it lists "
        "the fields that keep two configurations from sharing KV: the answer to 'why no hits?'.",
    )
    p.add_argument("--pins", help="identity.env pins file")
    p.add_argument("--model-folder", help="local HF-style model folder (config.json, tokenizer)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="vLLM --kv-cache-dtype; 'auto' resolves to the weights' dtype (default)")
    p.add_argument("--block-size", type=int, help="vLLM --block-size")
    p.add_argument("--tensor-parallel-size", type=int, help="vLLM -tp")
    p.add_argument("--pipeline-parallel-size", type=int, help="vLLM -pp")
    p.add_argument("--max-model-len", type=int, help="vLLM --max-model-len")
    p.add_argument("--with-build", action="store_true",
                   help="add the installed LMCache/vLLM build identity even without a model folder")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two configurations")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_identity)

    p = sub.add_parser(
        "status",
        help="the LMCache server's pid, health, ports and /status (read over HTTP)",
        description="Read the pid file (never trusted blindly: a dead or reused pid is "
        "reported as stale) and the server's HTTP API. Exit 3 when the server is not healthy.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "server",
        help="start, stop or inspect the LMCache MP server for KVP_CACHE_ROOT",
        description="start: validate settings, check ports and root, spawn `lmcache server` in "
        "the background with telemetry off, write KVP_CACHE_ROOT/lmcache-server.pid and wait for "
        "/healthcheck. stop: SIGTERM the recorded process (only if pid and start time match) "
        "and wait; SIGKILL after KVP_STOP_TIMEOUT_S.",
    )
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_server)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
