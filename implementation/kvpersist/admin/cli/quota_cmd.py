"""``kvp-admin quota set|show|check``: per-namespace quotas in ``quotas.json``."""

from __future__ import annotations

import argparse
import sys

from ..budget import (
    GIB,
    QuotaError,
    check_namespace,
    load_quotas,
    over_quota,
    quota_bytes,
    save_quotas,
)
from .common import (
    EXIT_ERROR,
    EXIT_OFF,
    EXIT_OK,
    Subparsers,
    add_json,
    gib,
    inventory_or_exit,
    print_json,
    quotas_path,
    settings_or_exit,
    table,
)


def cmd_quota(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    path = quotas_path(args, settings)
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
                     inventory_or_exit(settings, "quota").namespaces().items()}
            over = over_quota(usage, quotas)
            if args.json:
                print_json({"over": over, "quotas": quotas, "usage": usage})
            else:
                rows = [(ns, gib(usage.get(ns, 0)), gib(q),
                         "OVER by " + gib(over[ns]) if ns in over else "ok")
                        for ns, q in sorted(quotas.items())]
                print(table(rows, ("namespace", "used GiB", "quota GiB", "state")))
            return EXIT_OFF if over else EXIT_OK
    except QuotaError as exc:
        print(f"kvp-admin quota {args.action}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json({"file": str(path), "quotas_gib": {k: v / GIB for k, v in quotas.items()}})
    else:
        print(f"quotas in {path}:")
        print(table([(ns, gib(q)) for ns, q in sorted(quotas.items())], ("namespace", "GiB")))
    return EXIT_OK


def register(sub: Subparsers) -> None:
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
    add_json(p)
    p.set_defaults(func=cmd_quota)
