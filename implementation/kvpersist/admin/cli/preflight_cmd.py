"""``kvp-admin preflight``: check the machine against the configuration before the first start."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...l2.inventory import InventoryError, build_inventory
from ..preflight import run_preflight
from .common import (
    EXIT_ERROR,
    EXIT_OK,
    Subparsers,
    add_json,
    admin_settings_or_exit,
    print_json,
    settings_or_exit,
    table,
)


def cmd_preflight(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    cache_bytes = 0
    if settings.cache_root.is_dir():
        try:
            cache_bytes = build_inventory(settings.cache_root).cache_bytes
        except InventoryError:
            cache_bytes = 0
    checks = run_preflight(settings, cache_bytes=cache_bytes,
                           pins=Path(args.pins) if args.pins else None,
                           production=not args.test,
                           device=admin_settings_or_exit().cache_mount)
    errors = [c for c in checks if c.level == "error"]
    if args.json:
        print_json({"ok": not errors, "checks": [c.__dict__ for c in checks]})
    else:
        print(table([(c.level.upper(), c.name, c.message) for c in checks],
                     ("level", "check", "message")))
        print("\npreflight: " + ("OK" if not errors else f"{len(errors)} blocking problem(s)"))
    return EXIT_ERROR if errors else EXIT_OK


def register(sub: Subparsers) -> None:
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
    add_json(p)
    p.set_defaults(func=cmd_preflight)
