"""``kvp-admin``: the operator's tool (also ``python3 -m kvpersist.cli``).

Invariants: every subcommand has ``--help`` and ``--json``; nothing here starts by itself,
and nothing deletes cache data.  Exit codes: 0 ok, 1 error, 2 usage, 3 "caching off"
(identity incomplete or contradicted) or "server not healthy".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .admin import (
    active_namespaces_from_server,
    apply_cleanup,
    build_report,
    prometheus_text,
    verify_files,
    write_textfile,
)
from .budget import GIB, BudgetModel, QuotaError, check_namespace, load_quotas, quota_bytes, save_quotas
from .identity import (
    FIELDS,
    IdentityError,
    IdentityResolution,
    diff_identities,
    load_pins,
    merge_sources,
)
from .identity_sources import CONNECTOR_NAME, build_identity, from_model_folder
from .inventory import LIVE, Inventory, InventoryError, build_inventory
from .l2_format import SUFFIX
from .pidfile import PidFileError
from .preflight import run_preflight
from .progress import stderr_progress
from .retention import plan_cleanup
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


# ------------------------------------------------------------------------- disk views


def _gib(n: float | int | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def _when(ts: float) -> str:
    import time as _t

    return _t.strftime("%Y-%m-%d %H:%M", _t.localtime(ts)) if ts else "-"


def _quotas_path(args: argparse.Namespace, settings: Any) -> Path:
    import os

    return Path(getattr(args, "quotas", None) or os.environ.get("KVP_QUOTAS_FILE")
                or settings.cache_root / "quotas.json")


def _inventory_or_exit(settings: Any, label: str) -> Inventory:
    try:
        progress = stderr_progress(f"{label}: scanning")
        try:
            return build_inventory(settings.cache_root, progress=progress)
        finally:
            if progress is not None:
                progress.close()
    except InventoryError as exc:
        print(f"kvp-admin {label}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def _active(args: argparse.Namespace, settings: Any) -> tuple[set[str], str]:
    given = set(getattr(args, "active", None) or [])
    for ns in given:
        check_namespace(ns, "--active")
    if given:
        return given, "--active"
    found = active_namespaces_from_server(settings.http_url)
    if found is None:
        return set(), "unknown (server not answering; give --active)"
    return found, "server"


def _report_data(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    settings = _settings_or_exit()
    inv = _inventory_or_exit(settings, "report")
    quotas = load_quotas(_quotas_path(args, settings))
    active, source = _active(args, settings)
    budget = BudgetModel.from_gb(settings.budget_gb, settings.eviction_watermark,
                                 settings.eviction_ratio)
    data = build_report(inv, budget, quotas, active)
    data["active_source"] = source
    return data, settings


def cmd_report(args: argparse.Namespace) -> int:
    try:
        data, _ = _report_data(args)
    except QuotaError as exc:
        print(f"kvp-admin report: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        _print_json(data)
        return EXIT_OK
    rows = [(r["namespace"], ",".join(r["model_ids"]), r["files"], _gib(r["bytes"]),
             f"{100 * r['budget_share']:.2f}%", _when(r["last_access"]), r["state"],
             _gib(r["quota_bytes"]), "OVER" if r["over_quota_bytes"] else "")
            for r in data["namespaces"]]
    print(f"cache root {data['root']}: {_gib(data['cache_bytes'])} GiB of budget "
          f"{_gib(data['budget_bytes'])} GiB ({100 * data['budget_share']:.2f}%); eviction at "
          f"{_gib(data['trigger_bytes'])} GiB down to {_gib(data['reclaim_target_bytes'])} GiB")
    print(f"active namespaces from: {data['active_source']}\n")
    print(_table(rows, ("namespace", "model id", "files", "GiB", "budget", "last access",
                        "state", "quota GiB", "quota")))
    print()
    print(_table([(c, v["files"], _gib(v["bytes"])) for c, v in data["classes"].items()],
                 ("class", "files", "GiB")))
    for err in data["errors"]:
        print(f"warning: {err}", file=sys.stderr)
    return EXIT_OK


def cmd_metrics(args: argparse.Namespace) -> int:
    try:
        data, settings = _report_data(args)
    except QuotaError as exc:
        print(f"kvp-admin metrics: {exc}", file=sys.stderr)
        return EXIT_ERROR
    text = prometheus_text(data)
    if args.textfile:
        write_textfile(Path(args.textfile), text)
        return EXIT_OK
    if args.serve:
        return _serve_metrics(args, settings)
    sys.stdout.write(text)
    return EXIT_OK


def _serve_metrics(args: argparse.Namespace, settings: Any) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = prometheus_text(_report_data(args)[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((args.bind, args.serve), Handler)
    print(f"serving Prometheus metrics on http://{args.bind}:{args.serve}/metrics", file=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return EXIT_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    try:
        quotas = load_quotas(_quotas_path(args, settings))
        active, source = _active(args, settings)
        only = {check_namespace(ns, "--namespace") for ns in args.namespace} if args.namespace else None
    except QuotaError as exc:
        print(f"kvp-admin cleanup: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.apply and source.startswith("unknown") and not args.no_active:
        print("kvp-admin cleanup: the server does not answer, so the active namespaces are "
              "unknown; give --active NS (repeatable) or --no-active to treat all as stale",
              file=sys.stderr)
        return EXIT_ERROR
    inv = _inventory_or_exit(settings, "cleanup")
    target = None if args.target_gb is None else quota_bytes(args.target_gb, "--target-gb")
    plan = plan_cleanup(inv, active=active, quotas=quotas, target_bytes=target,
                        only_namespaces=only, include_unparsable=args.include_unparsable,
                        min_temp_age_s=args.min_temp_age)
    summary: dict[str, Any] = {
        "apply": args.apply, "active": sorted(active), "active_source": source,
        "start_bytes": plan.start_bytes, "target_bytes": plan.target_bytes,
        "planned_bytes": plan.planned_bytes, "end_bytes": plan.end_bytes,
        "by_class": {r: {"files": n, "bytes": b} for r, (n, b) in plan.bytes_by_reason().items()},
        "skipped_young_temp": plan.skipped_young_temp, "notes": plan.notes,
    }
    if args.apply:
        server_up = active_namespaces_from_server(settings.http_url) is not None
        server_url = settings.http_url if server_up else None
        progress = stderr_progress("cleanup: deleting", len(plan))
        try:
            res = apply_cleanup(plan, settings.cache_root, server_url=server_url, progress=progress)
        finally:
            if progress is not None:
                progress.close()
        summary.update({"deleted_files": res.deleted_files, "deleted_bytes": res.deleted_bytes,
                        "via_server": res.via_server, "vanished": res.vanished,
                        "refused": res.refused})
    if args.json:
        summary["items"] = [{"path": str(i.file.path), "class": i.reason, "bytes": i.file.size,
                             "namespace": i.file.namespace} for i in plan.items]
        _print_json(summary)
        return EXIT_OK
    verb = "deleted" if args.apply else "would delete (dry run; --apply to delete)"
    print(f"cleanup of {settings.cache_root}: {_gib(plan.start_bytes)} GiB now, "
          f"{verb} {_gib(plan.planned_bytes)} GiB, leaving {_gib(plan.end_bytes)} GiB"
          + ("" if target is None else f" (target {_gib(target)} GiB)"))
    print(f"active namespaces from: {source}: {', '.join(sorted(active)) or '-'}\n")
    print(_table([(r, v["files"], _gib(v["bytes"])) for r, v in summary["by_class"].items()],
                 ("class", "files", "GiB")))
    if plan.skipped_young_temp:
        print(f"skipped {plan.skipped_young_temp} temp file(s) younger than "
              f"{args.min_temp_age:.0f}s (possibly being written)")
    for note in plan.notes:
        print(f"note: {note}")
    if args.apply:
        print(f"deleted {summary['deleted_files']} files ({_gib(summary['deleted_bytes'])} GiB), "
              f"{summary['via_server']} through the server; {len(summary['refused'])} refused")
        for line in summary["refused"]:
            print(f"refused: {line}", file=sys.stderr)
    return EXIT_OK


def cmd_quota(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    path = _quotas_path(args, settings)
    try:
        quotas = load_quotas(path)
        if args.action == "set":
            ns = check_namespace(args.namespace, "namespace")
            if args.gb is None:
                quotas.pop(ns, None)
            else:
                quotas[ns] = quota_bytes(args.gb, "quota")
            save_quotas(path, quotas)
        if args.action == "check":
            usage = {ns: u.bytes for ns, u in
                     _inventory_or_exit(settings, "quota").namespaces().items()}
            over = {ns: usage.get(ns, 0) - q for ns, q in quotas.items() if usage.get(ns, 0) > q}
            if args.json:
                _print_json({"over": over, "quotas": quotas, "usage": usage})
            else:
                rows = [(ns, _gib(usage.get(ns, 0)), _gib(q),
                         "OVER by " + _gib(over[ns]) if ns in over else "ok")
                        for ns, q in sorted(quotas.items())]
                print(_table(rows, ("namespace", "used GiB", "quota GiB", "state")))
            return EXIT_OFF if over else EXIT_OK
    except QuotaError as exc:
        print(f"kvp-admin quota {args.action}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        _print_json({"file": str(path), "quotas_gib": {k: v / GIB for k, v in quotas.items()}})
    else:
        print(f"quotas in {path}:")
        print(_table([(ns, _gib(q)) for ns, q in sorted(quotas.items())], ("namespace", "GiB")))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    inv = _inventory_or_exit(settings, "verify")
    rate = args.max_mb_per_s * 1024**2 if args.max_mb_per_s else None
    files = [inv.file(i) for i in inv.of_class(LIVE) if inv.name(int(i)).endswith(SUFFIX)]
    progress = stderr_progress("verify", len(files))
    try:
        res = verify_files(settings.cache_root, files, quarantine=args.quarantine,
                           max_bytes_per_s=rate, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        _print_json({"checked": res.checked, "bytes_read": res.bytes_read,
                     "failures": [{"path": p, "reason": r} for p, r in res.failures],
                     "quarantined": res.quarantined, "seconds": round(res.seconds, 3)})
    else:
        print(f"verified {res.checked} files ({_gib(res.bytes_read)} GiB) in {res.seconds:.1f}s: "
              f"{len(res.failures)} failed, {res.quarantined} quarantined")
        for path, reason in res.failures:
            print(f"  {reason}: {path}")
    return EXIT_OFF if res.failures and not args.quarantine else EXIT_OK


def cmd_preflight(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    cache_bytes = 0
    if settings.cache_root.is_dir():
        try:
            cache_bytes = build_inventory(settings.cache_root).cache_bytes
        except InventoryError:
            cache_bytes = 0
    checks = run_preflight(settings, cache_bytes=cache_bytes,
                           pins=Path(args.pins) if args.pins else None,
                           production=not args.test)
    errors = [c for c in checks if c.level == "error"]
    if args.json:
        _print_json({"ok": not errors, "checks": [c.__dict__ for c in checks]})
    else:
        print(_table([(c.level.upper(), c.name, c.message) for c in checks],
                     ("level", "check", "message")))
        print("\npreflight: " + ("OK" if not errors else f"{len(errors)} blocking problem(s)"))
    return EXIT_ERROR if errors else EXIT_OK


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

    def add_active(p: argparse.ArgumentParser) -> None:
        p.add_argument("--active", action="append", metavar="NS",
                       help="an active namespace (repeatable); default: asked from the server")
        p.add_argument("--quotas", help="quotas.json (default: $KVP_QUOTAS_FILE or "
                       "KVP_CACHE_ROOT/quotas.json)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "report",
        help="per namespace: files, bytes, budget share, last access, active/stale, quota",
        description="Measure KVP_CACHE_ROOT from the disk (names and sizes only, no reads) and "
        "show, per namespace, the model id, files, bytes, share of the budget, last access, "
        "whether it is active (the running server's engines, or --active) and its quota; then "
        "totals per class: live, temp leftovers, quarantine, unparsable names, foreign files.",
    )
    add_active(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "preflight",
        help="check the machine against the configuration before starting (exit 1 if blocked)",
        description="Checks: the device can hold the budget (free space + cache bytes), free "
        "space, the cache root, the ports, persist_enabled, telemetry, the identity pins "
        "(--pins) and the file-system type of the root (tmpfs/overlay: test only; nfs and "
        "other network file systems: no rename atomicity or shared accounting; wekafs: the GDS "
        "profile). Each problem says how to fix it. Exit 1 on any blocking problem.",
    )
    p.add_argument("--pins", help="configs/<model>/identity.env to check for completeness")
    p.add_argument("--test", action="store_true", help="a test machine: tmpfs/overlay are fine")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser(
        "cleanup",
        help="plan (dry run) or --apply an explicit cleanup, ranked by retention policy",
        description="Ranks what may go: (1) temp leftovers and quarantine, (2) stale "
        "namespaces, oldest last access first, (3) active namespaces over quota, (4) with "
        "--target-gb, the LRU tail of the active namespaces; stops at the target. Dry run by "
        "default. Never touches anything outside the root or anything that is not a cache file; "
        "skips temp files younger than --min-temp-age (a store in progress); while the server "
        "runs, live files are deleted through its API so its index stays right.",
    )
    add_active(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--apply", action="store_true", help="really delete (default: dry run)")
    mode.add_argument("--dry-run", action="store_true",
                      help="only print the plan (the default; for scripts that want to say so)")
    p.add_argument("--namespace", action="append", metavar="NS",
                   help="only these namespaces (repeatable); temp/quarantine are then left alone")
    p.add_argument("--target-gb", type=float, help="stop once the cache is at or below this")
    p.add_argument("--no-active", action="store_true",
                   help="with --apply and no server: treat every namespace as stale")
    p.add_argument("--include-unparsable", action="store_true",
                   help="also delete cache-suffixed files whose names do not parse")
    p.add_argument("--min-temp-age", type=float, default=300.0,
                   help="seconds a temp file must be old to count as a leftover (default 300)")
    p.set_defaults(func=cmd_cleanup)

    p = sub.add_parser(
        "quota",
        help="set, show or check per-namespace quotas (quotas.json)",
        description="quota set NS GB (omit GB to remove), quota show, quota check (exit 3 if a "
        "namespace is over quota). Quotas are enforced only by `cleanup`, never automatically.",
    )
    p.add_argument("action", choices=("set", "show", "check"))
    p.add_argument("namespace", nargs="?", help="kvp-<32 hex> (for set)")
    p.add_argument("gb", nargs="?", type=float, help="quota in GiB (for set)")
    p.add_argument("--quotas", help="quotas.json path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_quota)

    p = sub.add_parser(
        "verify",
        help="scrub every file's header and checksum (progress, throttling, --quarantine)",
        description="Read every kvpersist .kvp file and check its header and payload checksum "
        "against its name, as a load would. Exit 3 if any fails (without --quarantine).",
    )
    p.add_argument("--quarantine", action="store_true", help="move failures to quarantine/")
    p.add_argument("--max-mb-per-s", type=float, help="throttle reads to this rate")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "metrics",
        help="Prometheus text: bytes/files per namespace, classes, budget share",
        description="Print the metrics, write them atomically for node_exporter's textfile "
        "collector (--textfile), or serve them (--serve PORT, 127.0.0.1 by default).",
    )
    add_active(p)
    p.add_argument("--textfile", help="write to this .prom file atomically")
    p.add_argument("--serve", type=int, metavar="PORT", help="serve /metrics on this port")
    p.add_argument("--bind", default="127.0.0.1", help="address for --serve")
    p.set_defaults(func=cmd_metrics)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SystemExit as exc:  # helpers exit with a message already printed
        return int(exc.code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
