"""``kvp-admin compat``: would kvpersist keep its features on with this vLLM and this LMCache?

Reads the distributions' source files only (:mod:`kvpersist.admin.compat`): no GPU, and
neither package is imported, so a wheel of another build is checked on any host.
"""

from __future__ import annotations

import argparse
import sys

from ..compat import CompatError, check
from .common import Subparsers, add_json, print_json

#: "caching would not run", also when a distribution cannot be read (nothing is known safe)
EXIT_CLOSED = 2


def cmd_compat(args: argparse.Namespace) -> int:
    try:
        report = check(args.vllm, args.lmcache)
    except (CompatError, OSError) as exc:
        print(f"kvp-admin compat: {exc}", file=sys.stderr)
        return EXIT_CLOSED
    if args.json:
        print_json(report.to_json())
    else:
        print("\n".join(report.lines()))
    return report.exit_code


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "compat",
        help="check a vLLM / LMCache distribution against kvpersist, from source (exit 0/1/2)",
        description="Reads a vLLM and an LMCache distribution (default: the installed ones) "
        "without importing them or needing a GPU, and reports: each fence feature on or off "
        "(the LMCache functions whose source changed), vLLM engine configuration fields "
        "kvpersist never classified (they close the gate) and stale entries, and the connector "
        "API (kvpersist's and LMCache's vLLM imports, vLLM's KVConnectorBase_V1 against the "
        "tested version). A distribution is a folder holding the top-level package "
        "(site-packages, an unpacked wheel, a source checkout) or a .whl file.",
        epilog="Exit codes: 0 every feature on and nothing closes the gate; 1 caching runs with "
        "less (a feature off, or an API difference that degrades it) and the gate stays open; "
        "2 the gate would close or the connector would not load (an unsafe_without feature off, "
        "unclassified engine fields, an import or override that breaks), and also when a "
        "distribution cannot be read or the arguments are wrong.",
    )
    p.add_argument("--vllm", metavar="PATH",
                   help="vLLM: a .whl or a folder holding vllm/ (default: the installed one)")
    p.add_argument("--lmcache", metavar="PATH",
                   help="LMCache: a .whl or a folder holding lmcache/ (default: the installed "
                   "one)")
    add_json(p)
    p.set_defaults(func=cmd_compat)
