"""``kvp-admin cleanup``: the retention plan, a dry run unless ``--apply``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ...l2.lock import root_lock_holder
from ..budget import QuotaError, check_namespace, load_quotas, quota_bytes
from ..cleanup import apply_cleanup
from ..progress import stderr_progress
from ..report import active_namespaces_from_server
from ..retention import plan_cleanup
from .common import (
    EXIT_ERROR,
    EXIT_OK,
    Subparsers,
    active_namespaces,
    add_active_args,
    gib,
    inventory_or_exit,
    print_json,
    quotas_path,
    settings_or_exit,
    table,
)


def cmd_cleanup(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    try:
        quotas = load_quotas(quotas_path(args, settings))
        active, source = active_namespaces(args, settings)
        only = {check_namespace(ns, "--namespace") for ns in args.namespace} if args.namespace else None
    except QuotaError as exc:
        print(f"kvp-admin cleanup: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.apply and source.startswith("unknown") and not args.no_active:
        print(f"kvp-admin cleanup: the active namespaces are {source}; give --active NS "
              "(repeatable) or --no-active to treat all as stale", file=sys.stderr)
        return EXIT_ERROR
    inv = inventory_or_exit(settings, "cleanup")
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
        holder = root_lock_holder(settings.cache_root) if settings.shared else None
        if holder is not None and not server_up:
            print(f"kvp-admin cleanup: node {settings.node_id}'s part {settings.cache_root} is "
                  f"served by {holder}, a live server this node cannot reach; run the cleanup "
                  "on that node (its server keeps its index right), or stop it first",
                  file=sys.stderr)
            return EXIT_ERROR
        progress = stderr_progress("cleanup: deleting", len(plan))
        try:
            res = apply_cleanup(plan, settings.l2_roots, server_url=server_url,
                                progress=progress)
        finally:
            if progress is not None:
                progress.close()
        summary.update({"deleted_files": res.deleted_files, "deleted_bytes": res.deleted_bytes,
                        "via_server": res.via_server, "vanished": res.vanished,
                        "refused": res.refused})
    if args.json:
        summary["items"] = [{"path": str(i.file.path), "class": i.reason, "bytes": i.file.size,
                             "namespace": i.file.namespace} for i in plan.items]
        print_json(summary)
        return EXIT_OK
    verb = "deleted" if args.apply else "would delete (dry run; --apply to delete)"
    print(f"cleanup of {settings.cache_root}: {gib(plan.start_bytes)} GiB now, "
          f"{verb} {gib(plan.planned_bytes)} GiB, leaving {gib(plan.end_bytes)} GiB"
          + ("" if target is None else f" (target {gib(target)} GiB)"))
    print(f"active namespaces from: {source}: {', '.join(sorted(active)) or '-'}\n")
    print(table([(r, v["files"], gib(v["bytes"])) for r, v in summary["by_class"].items()],
                 ("class", "files", "GiB")))
    if plan.skipped_young_temp:
        print(f"skipped {plan.skipped_young_temp} temp file(s) younger than "
              f"{args.min_temp_age:.0f}s (possibly being written)")
    for note in plan.notes:
        print(f"note: {note}")
    if args.apply:
        print(f"deleted {summary['deleted_files']} files ({gib(summary['deleted_bytes'])} GiB), "
              f"{summary['via_server']} through the server; {len(summary['refused'])} refused")
        for line in summary["refused"]:
            print(f"refused: {line}", file=sys.stderr)
    return EXIT_OK


def register(sub: Subparsers) -> None:
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
    add_active_args(p)
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
