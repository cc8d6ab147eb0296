"""``kvp-admin tree``: a shared tree from any node (its parts, live holders, usage against the
shares of the budget, the namespaces a cleanup must leave alone)."""

from __future__ import annotations

import argparse
import sys

from ...l2.inventory import InventoryError
from ..tree import tree_report
from .common import EXIT_ERROR, EXIT_OK, Subparsers, add_json, gib, print_json, settings_or_exit, table

GIB = 1024**3


def cmd_tree(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    try:
        data = tree_report(settings.tree, int(settings.budget_gb * GIB), settings.shared_nodes)
    except InventoryError as exc:
        print(f"kvp-admin tree: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json(data)
        return EXIT_OK
    print(f"shared tree {data['tree']}: {gib(data['tree_bytes'])} GiB in {data['tree_files']} "
          f"files of budget {gib(data['budget_bytes'])} GiB ({data['shares']} shares of "
          f"{gib(data['share_bytes'])} GiB)\n")
    print(table([(n["node_id"], n["holder"] or "-", n["files"], gib(n["bytes"]),
                  f"{100 * n['share_used']:.1f}%", len(n["namespaces"]), n["error"] or "")
                 for n in data["nodes"]],
                ("node", "live server", "files", "GiB", "of share", "namespaces", "error")))
    print(f"\nprotected namespaces (recorded in a live part): "
          f"{', '.join(data['protected_namespaces']) or '-'}")
    if data["parts_beyond_shares"]:
        print(f"WARNING: {len(data['nodes'])} node parts but KVP_SHARED_NODES={data['shares']}: "
              "the tree can exceed its budget; raise KVP_SHARED_NODES on every node, or remove a "
              "retired node's part", file=sys.stderr)
    return EXIT_OK


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "tree",
        help="a shared tree (KVP_NODE_ID): every node's part, live or not, against the budget",
        description="For a tree several nodes share (KVP_CACHE_ROOT mounted on each, KVP_NODE_ID "
        "per node): list <tree>/nodes/*, say which part a server holds now (its root lock, "
        "pid@host, seen from any node), count files and bytes per part from the disk against "
        "its share (KVP_CACHE_BUDGET_GB / KVP_SHARED_NODES), and name the namespaces recorded "
        "in live parts, which `cleanup` treats as active on every node. Read-only.",
    )
    add_json(p)
    p.set_defaults(func=cmd_tree)
