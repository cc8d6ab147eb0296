"""``kvp-admin recovery-test``: the recovery acceptance test against the deployment (see
:mod:`kvpersist.admin.recovery`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..page_cache import EVICT_CHOICES
from ..recovery import EXIT_CODES, default_out, run_recovery_test
from .common import Subparsers, add_json, admin_settings_or_exit, print_json, settings_or_exit


def cmd_recovery_test(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    recipe = [a for a in args.recipe if a != "--"]
    if not recipe:
        print("kvp-admin recovery-test: give the model and the recipe's vLLM arguments after "
              "`--`, e.g. kvp-admin recovery-test -- /models/m -tp 4 --max-model-len 32768",
              file=sys.stderr)
        return 2
    admin = admin_settings_or_exit()
    out = Path(args.out).absolute() if args.out else default_out(admin.results_dir)
    verdict, test = run_recovery_test(
        settings, recipe, out, words=args.words,
        device=args.device or admin.block_device, evict=args.evict,
        restart=args.restart or admin.server_restart,
        vllm_timeout_s=args.vllm_timeout, request_timeout_s=args.request_timeout)
    if args.json:
        print_json({"verdict": verdict, "out": str(out),
                    "checks": [c.__dict__ for c in test.checks]})
    else:
        print(f"{verdict}: {sum(c.status == 'PASS' for c in test.checks)}/{len(test.checks)} "
              f"checks passed; results in {out} (failures.txt lists the others)")
    return EXIT_CODES[verdict]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "recovery-test",
        help="acceptance test: a chat comes back from L2 after vLLM restarts (A) and after both "
        "restart (B); PASS/FAIL/INCONCLUSIVE",
        description="Against the running server (settings from the environment, as kvp-server) "
        "and vLLM started through kvp-vllm with the recipe's arguments (given after --, "
        "KVP_IDENTITY_PINS set): a new chat is sent cold, then after restarting vLLM with L1 "
        "cleared (A) and after restarting vLLM and the server with the page cache dropped (B). "
        "Each scenario must show: stored before the restart (L2 bytes and store counters grew), "
        "cached_tokens > 0, the hit from L2 (server L2 hit counter; in B the read sectors of "
        "KVP_CACHE_BLOCK_DEVICE in /proc/diskstats), no new L2 data, TTFT below the cold one, the "
        "same answer at temperature 0. Exit 0 PASS, 1 FAIL, 2 INCONCLUSIVE (evidence that "
        "cannot be had, e.g. no block device). Writes results.json and failures.txt. Restarts "
        "the server (with KVP_SERVER_RESTART, e.g. 'systemctl restart kvp-server', for a "
        "server a unit manages; the test refuses to restart such a server itself): run it in "
        "a maintenance window.",
    )
    p.add_argument("recipe", nargs=argparse.REMAINDER,
                   help="-- MODEL [vLLM args...]: what kvp-vllm would be given")
    p.add_argument("--out", help="results folder (default $KVP_RESULTS_DIR/<UTC>-recovery, "
                   "KVP_RESULTS_DIR defaulting to /var/tmp/kvpersist-results)")
    p.add_argument("--restart", default=None,
                   help="the command that restarts the server (default $KVP_SERVER_RESTART; "
                   "empty: kvp-server stop and start, for a server this account runs by hand)")
    p.add_argument("--words", type=int, default=600,
                   help="length of the test chat in words (default 600; it must fill at least "
                   "one LMCache chunk and fit --max-model-len)")
    p.add_argument("--device", default=None,
                   help="block device of the cache for the disk evidence (default "
                   "$KVP_CACHE_BLOCK_DEVICE, else the device holding KVP_CACHE_ROOT)")
    p.add_argument("--evict", choices=EVICT_CHOICES, default="page-cache",
                   help="how scenario B's restore is made cold: page-cache drops the whole "
                   "page cache (root; default), cache-files evicts only the pages of the files "
                   "under KVP_CACHE_ROOT, so the node's other processes keep theirs (the choice "
                   "on a node that serves other work; the device reads are the same evidence)")
    p.add_argument("--vllm-timeout", type=float, default=900.0,
                   help="seconds vLLM may take to start (default 900)")
    p.add_argument("--request-timeout", type=float, default=900.0,
                   help="seconds one request may take (default 900)")
    add_json(p)
    p.set_defaults(func=cmd_recovery_test)
