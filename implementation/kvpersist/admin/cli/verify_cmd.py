"""``kvp-admin verify``: scrub every file's header and checksum, as a load would."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ...config.server import ServerSettings
from ...l2.inventory import LIVE
from ...l2.layout import SUFFIX, KeyFields, format_name
from ...l2.lock import take_root_lock
from ...l2.roots import shares
from ...l2.store import KvFileStore, RootLockedError
from ..budget import GIB
from ..progress import stderr_progress
from ..verify import verify_files
from .common import (
    EXIT_ERROR,
    EXIT_OFF,
    EXIT_OK,
    Subparsers,
    add_json,
    gib,
    inventory_or_exit,
    print_json,
    settings_or_exit,
)


def cmd_check(settings: ServerSettings, as_json: bool) -> int:
    """The store's consistency oracle on every root, none served (it takes each root's lock),
    and no key on two roots."""
    files = used = 0
    problems: list[str] = []
    seen: dict[KeyFields, Path] = {}
    several = len(settings.l2_roots) > 1
    for root, share in zip(settings.l2_roots, shares(int(settings.node_budget_gb * GIB),
                                                     len(settings.l2_roots)), strict=True):
        # scan_snapshot off: the check neither consumes the server's snapshot nor leaves one
        store = KvFileStore(root, share, sharded=settings.l2_sharded, scan_snapshot=False)
        try:
            store.open(background_scan=False, remove_temps=False)
        except RootLockedError as exc:
            print(f"kvp-admin verify --check: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except OSError as exc:
            problems.append(f"{root}: cannot be opened ({exc.strerror or exc})")
            continue
        try:
            prefix = f"{root}: " if several else ""
            problems += [prefix + p for p in store.check(deep=True)]
            n, b, _ = store.index.totals()
            files, used = files + n, used + b
            for key in store.index.snapshot():
                if key in seen:
                    problems.append(f"{format_name(key)} is on {seen[key]} and on {root}")
                seen.setdefault(key, root)
        finally:
            store.close()
    if as_json:
        print_json({"files": files, "bytes": used, "problems": problems})
    else:
        print(f"checked {files} files ({gib(used)} GiB): "
              + ("consistent" if not problems else f"{len(problems)} problem(s)"))
        for problem in problems:
            print(f"  {problem}")
    return EXIT_OFF if problems else EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    if args.check:
        return cmd_check(settings, args.json)
    lock_fds: list[int] = []
    try:
        if args.quarantine:  # moving files changes what a server's index counts: never behind one
            try:
                for root in settings.l2_roots:
                    lock_fds.append(take_root_lock(root))
            except RootLockedError as exc:
                print(f"kvp-admin verify --quarantine: {exc}. A running server verifies every "
                      "file it reads and quarantines what fails; stop it to quarantine from "
                      "here, or run without --quarantine to only report", file=sys.stderr)
                return EXIT_ERROR
        return _verify(args, settings)
    finally:
        for fd in lock_fds:
            os.close(fd)


def _verify(args: argparse.Namespace, settings: ServerSettings) -> int:
    inv = inventory_or_exit(settings, "verify")
    rate = args.max_mb_per_s * 1024**2 if args.max_mb_per_s else None
    files = [inv.file(i) for i in inv.of_class(LIVE) if inv.name(int(i)).endswith(SUFFIX)]
    progress = stderr_progress("verify", len(files))
    try:
        res = verify_files(settings.l2_roots, files, quarantine=args.quarantine,
                           max_bytes_per_s=rate, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print_json({"checked": res.checked, "bytes_read": res.bytes_read,
                     "failures": [{"path": p, "reason": r} for p, r in res.failures],
                     "quarantined": res.quarantined, "vanished": res.vanished,
                     "seconds": round(res.seconds, 3),
                     "per_rank": dict(sorted(res.per_rank.items()))})
    else:
        print(f"verified {res.checked} files ({gib(res.bytes_read)} GiB) in {res.seconds:.1f}s: "
              f"{len(res.failures)} failed, {res.quarantined} quarantined"
              + (f", {res.vanished} gone meanwhile (evicted or cleaned up)" if res.vanished
                 else ""))
        if len(res.per_rank) > 1:
            print("  per rank (rank/world size): " + ", ".join(
                f"{label} {row['checked']} checked, {row['failed']} failed"
                for label, row in sorted(res.per_rank.items())))
        for path, reason in res.failures:
            print(f"  {reason}: {path}")
    return EXIT_OFF if res.failures and not args.quarantine else EXIT_OK


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "verify",
        help="scrub every file's header and checksum (progress, throttling, --quarantine)",
        description="Read every kvpersist .kvp file and check its header and payload checksum "
        "against its name, as a load would. Exit 3 if any fails (without --quarantine).",
    )
    p.add_argument("--quarantine", action="store_true",
                   help="move failures to quarantine/ (with the server stopped: it takes the "
                   "root's lock, as the server does)")
    p.add_argument("--max-mb-per-s", type=float, help="throttle reads to this rate")
    p.add_argument("--check", action="store_true",
                   help="with the server stopped: open the root as the server would (no temp "
                   "file is removed) and check that the index equals the files, the byte count "
                   "their sizes, no temp file is left, every file verifies, and quarantine "
                   "holds only failures (KvFileStore.check); exit 3 if anything is found")
    add_json(p)
    p.set_defaults(func=cmd_verify)
