"""``kvp-admin report`` (per-namespace usage, measured from the disk) and ``kvp-admin metrics``
(the same figures as Prometheus text: printed, written for a textfile collector, or served)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from ...config.server import ServerSettings
from ...l2.roots import shares
from ...serving import http
from ..budget import BudgetModel, QuotaError, load_quotas
from ..metrics import prometheus_text, relay_server_metrics, write_textfile
from ..report import build_report, root_usage
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
    when,
)


def _report_data(args: argparse.Namespace, label: str) -> tuple[dict[str, Any], ServerSettings]:
    """The report, or exit 1 with a message naming the problem (settings, quotas, root)."""
    settings = settings_or_exit()
    try:
        quotas = load_quotas(quotas_path(args, settings))
        active, source = active_namespaces(args, settings)
    except QuotaError as exc:
        print(f"kvp-admin {label}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    inv = inventory_or_exit(settings, label)
    budget = BudgetModel.from_gb(settings.node_budget_gb, settings.eviction_watermark,
                                 settings.eviction_ratio)
    data = build_report(inv, budget, quotas, active)
    data["active_source"] = source
    data["roots"] = root_usage(inv, settings.l2_roots,
                               shares(budget.cap_bytes, len(settings.l2_roots)))
    return data, settings


def _ranks(coverage: dict[str, object]) -> str:
    """``0/2:5 1/2:5`` (rank/world size: files), and ``INCOMPLETE`` when a chunk lacks a rank."""
    per_rank = coverage["files_per_rank"]
    assert isinstance(per_rank, dict)
    text = " ".join(f"{k}:{v}" for k, v in per_rank.items())
    return text if coverage["complete"] else f"{text} INCOMPLETE"


def cmd_report(args: argparse.Namespace) -> int:
    data, _ = _report_data(args, "report")
    if args.json:
        print_json(data)
        return EXIT_OK
    rows = [(r["namespace"], ",".join(r["model_ids"]), r["files"], _ranks(r["ranks"]),
             gib(r["bytes"]), f"{100 * r['budget_share']:.2f}%", when(r["last_access"]),
             r["state"], gib(r["quota_bytes"]), "OVER" if r["over_quota_bytes"] else "")
            for r in data["namespaces"]]
    print(f"cache root {data['root']}: {gib(data['cache_bytes'])} GiB of budget "
          f"{gib(data['budget_bytes'])} GiB ({100 * data['budget_share']:.2f}%); eviction at "
          f"{gib(data['trigger_bytes'])} GiB down to {gib(data['reclaim_target_bytes'])} GiB")
    if len(data["roots"]) > 1:
        print(table([(r["root"], r["files"], gib(r["bytes"]), gib(r["budget_bytes"]),
                      f"{100 * r['budget_share']:.2f}%") for r in data["roots"]],
                    ("root (device)", "files", "GiB", "share GiB", "of share")))
    print(f"active namespaces from: {data['active_source']}\n")
    print(table(rows, ("namespace", "model id", "files", "files per rank", "GiB", "budget",
                        "last access", "state", "quota GiB", "quota")))
    for r in data["namespaces"]:
        for tag, a in r["lora_adapters"].items():
            named = ", ".join(a["names"]) or "no adapter record"
            print(f"namespace {r['namespace']}: LoRA adapter {tag} ({named}): {a['files']} "
                  f"files, {gib(a['bytes'])} GiB")
    for r in data["namespaces"]:
        cov = r["ranks"]
        if not cov["complete"]:
            missing = ", ".join(f"rank {k}: {v}" for k, v in cov["missing_per_rank"].items())
            print(f"warning: namespace {r['namespace']} is incomplete: "
                  f"{cov['incomplete_chunks']} of {cov['chunks']} chunks lack a rank's file "
                  f"({missing}) and can never hit", file=sys.stderr)
    print()
    print(table([(c, v["files"], gib(v["bytes"])) for c, v in data["classes"].items()],
                 ("class", "files", "GiB")))
    for err in data["errors"]:
        print(f"warning: {err}", file=sys.stderr)
    return EXIT_OK


def _metrics_text(args: argparse.Namespace) -> tuple[str, ServerSettings]:
    data, settings = _report_data(args, "metrics")
    text = prometheus_text(data)
    if not args.no_server:
        resp = None
        with contextlib.suppress(http.HttpError):
            resp = http.get(settings.http_url + "/metrics", timeout=5.0)
        text += relay_server_metrics(resp.body.decode(errors="replace")
                                     if resp is not None and resp.ok else None)
    return text, settings


def cmd_metrics(args: argparse.Namespace) -> int:
    text, settings = _metrics_text(args)
    if args.textfile:
        write_textfile(Path(args.textfile), text)
        return EXIT_OK
    if args.serve:
        return _serve_metrics(args, settings)
    sys.stdout.write(text)
    return EXIT_OK


def _serve_metrics(args: argparse.Namespace, settings: ServerSettings) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            try:
                body = _metrics_text(args)[0].encode()
            except SystemExit:  # the reason went to stderr; keep serving
                self.send_error(500, "kvp-admin metrics failed; see its stderr")
                return
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


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "report",
        help="per namespace: files, bytes, budget share, last access, active/stale, quota",
        description="Measure KVP_CACHE_ROOT from the disk (names and sizes only, no reads) and "
        "show, per namespace, the model id, files, bytes, share of the budget, last access, "
        "whether it is active (the running server's engines, or --active) and its quota; then "
        "totals per class: live, temp leftovers, quarantine, unparsable names, foreign files.",
    )
    add_active_args(p)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser(
        "metrics",
        help="Prometheus text: bytes/files per namespace, classes, budget share, and the "
        "server's own counters",
        description="Print the metrics, write them atomically for node_exporter's textfile "
        "collector (--textfile), or serve them (--serve PORT, 127.0.0.1 by default). The "
        "running server's lmcache_mp_* and kvpersist_l2_* metrics are relayed (its admin API is "
        "a Unix socket that Prometheus cannot scrape); kvpersist_server_up says whether it "
        "answered. configs/prometheus/kvpersist.yml is a scrape example; "
        "configs/grafana/kvpersist.json the dashboard.",
    )
    add_active_args(p)
    p.add_argument("--textfile", help="write to this .prom file atomically")
    p.add_argument("--serve", type=int, metavar="PORT", help="serve /metrics on this port")
    p.add_argument("--bind", default="127.0.0.1", help="address for --serve")
    p.add_argument("--no-server", action="store_true",
                   help="leave out the server's relayed metrics (and kvpersist_server_up)")
    p.set_defaults(func=cmd_metrics)
