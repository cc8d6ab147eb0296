"""``kvp-admin``: the operator's tool (also ``python3 -m kvpersist.admin.cli``).

One module per command (``*_cmd.py``, each with ``register(sub)``); ``common`` holds what they
share.  Invariants: every subcommand has ``--help`` and ``--json``; nothing here starts by itself
(only ``server`` and ``recovery-test`` start or restart processes, when asked), and nothing
deletes cache data without ``cleanup --apply``.  Exit codes: 0 ok, 1 error, 2 usage, 3 "caching off"
(identity incomplete or contradicted) or "server not healthy".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import (
    cleanup_cmd,
    compat_cmd,
    identity_cmd,
    preflight_cmd,
    quota_cmd,
    recovery_cmd,
    report_cmd,
    server_cmd,
    tree_cmd,
    verify_cmd,
)

# Subcommands in the order `kvp-admin --help` lists them; each module registers its own parser(s).
COMMANDS = (identity_cmd, server_cmd, report_cmd, tree_cmd, preflight_cmd, cleanup_cmd, quota_cmd,
            verify_cmd, recovery_cmd, compat_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvp-admin",
        description="Operate the kvpersist KV-cache tier: compatibility identities, the LMCache "
        "server, what is on disk (report, cleanup, quota, verify, metrics) and preflight checks. "
        "Settings come from the lmcache-server.env template (configs/generic in a checkout) "
        "overridden by the environment "
        "(KVP_CACHE_ROOT, KVP_L1_SIZE_GB, KVP_CACHE_BUDGET_GB, KVP_RUNTIME_DIR, KVP_ACCESS, ...).",
        epilog="Nothing runs by itself and nothing is deleted without `cleanup --apply`; only "
        "`server` and `recovery-test` start or restart processes. "
        "Examples: kvp-admin report; kvp-admin identity diff a.env b.env (why no hits?); "
        "kvp-admin cleanup --target-gb 1200 (dry run); kvp-admin COMMAND --help for each.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["identity"]:
        words = ["identity", *identity_cmd.identity_argv(words[1:])]
    try:
        args = build_parser().parse_args(words)
        return int(args.func(args))
    except SystemExit as exc:  # helpers exit with a message already printed
        return int(exc.code or 0)


def server_main(argv: Sequence[str] | None = None) -> int:
    """``kvp-server start|stop|status``: the same as ``kvp-admin server ...``."""
    return main(["server", *(sys.argv[1:] if argv is None else argv)])
