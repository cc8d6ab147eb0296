"""What every ``kvp-admin`` subcommand shares: exit codes, output shapes (tables, ``--json``) and
the settings, inventory and active namespaces they work on."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

from ...config.admin import AdminSettings, load_admin_settings
from ...config.server import ServerSettings, SettingsError, load_settings
from ...l2.inventory import Inventory, InventoryError, build_inventory, merge_inventories
from ..budget import GIB, check_namespace
from ..progress import stderr_progress
from ..report import active_namespaces_from_server
from ..tree import live_recorded_namespaces

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_OFF = 0, 1, 2, 3
_S = TypeVar("_S")
# What ``register(sub)`` of each command module receives.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_active_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--active", action="append", metavar="NS",
                   help="an active namespace (repeatable); default: asked from the server")
    p.add_argument("--quotas", help="quotas.json (default: $KVP_QUOTAS_FILE or "
                   "KVP_CACHE_ROOT/quotas.json)")
    add_json(p)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def gib(n: float | int | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def settings_or_exit() -> ServerSettings:
    return _loaded_or_exit(load_settings)


def admin_settings_or_exit() -> AdminSettings:
    return _loaded_or_exit(load_admin_settings)


def _loaded_or_exit(load: Callable[[], _S]) -> _S:
    """``load()``, or exit 1 with its SettingsError (which names the setting) on stderr."""
    try:
        return load()
    except SettingsError as exc:
        print(f"kvp-admin: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def quotas_path(args: argparse.Namespace, settings: ServerSettings) -> Path:
    given = getattr(args, "quotas", None)
    if given:
        return Path(given)
    return admin_settings_or_exit().quotas_file or settings.cache_root / "quotas.json"


def inventory_or_exit(settings: ServerSettings, label: str) -> Inventory:
    """Every root's files in one inventory.  The primary root must be readable (it is the
    tier's); an extra root that is not (its device lost) is named on stderr and left out, so
    the operator still sees and acts on the rest."""
    parts: list[Inventory] = []
    for root in settings.l2_roots:
        try:
            progress = stderr_progress(f"{label}: scanning {root}" if settings.extra_roots
                                       else f"{label}: scanning")
            try:
                parts.append(build_inventory(root, progress=progress))
            finally:
                if progress is not None:
                    progress.close()
        except InventoryError as exc:
            print(f"kvp-admin {label}: {exc}", file=sys.stderr)
            if root == settings.cache_root:
                raise SystemExit(EXIT_ERROR) from None
            print(f"kvp-admin {label}: root {root} left out; its files are not counted",
                  file=sys.stderr)
    return merge_inventories(parts)


def active_namespaces(args: argparse.Namespace, settings: ServerSettings) -> tuple[set[str], str]:
    given = set(getattr(args, "active", None) or [])
    for ns in given:
        check_namespace(ns, "--active")
    if given:
        return given, "--active"
    found = active_namespaces_from_server(settings.http_url)
    if settings.shared:  # any node may read any part: every live node's namespaces count
        try:
            protected = live_recorded_namespaces(settings.tree)
        except InventoryError as exc:  # nobody knows which namespaces live nodes serve
            return found or set(), f"unknown (the tree's parts cannot be listed: {exc})"
        if found is None:
            return protected, "live nodes' records (this node's server not answering)"
        return found | protected, "server + live nodes' records"
    if found is None:
        return set(), "unknown (the server does not answer)"
    return found, "server"
