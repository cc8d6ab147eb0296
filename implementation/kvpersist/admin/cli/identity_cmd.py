"""``kvp-admin identity``: resolve a configuration's identity and namespace; ``--diff`` explains
field by field why two configurations never share KV (the answer to "why no hits?")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...identity import (
    FIELDS,
    NAMESPACE_RE,
    CacheIdentity,
    IdentityError,
    IdentityResolution,
    diff_identities,
    load_pins,
    merge_sources,
)
from ...identity.records import list_records, read_record
from ...identity.sources import CONNECTOR_NAME, build_identity, from_model_folder
from ..report import active_namespaces_from_server
from .common import (
    EXIT_ERROR,
    EXIT_OFF,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_json,
    print_json,
    settings_or_exit,
    table,
)


def resolve_cli_identity(args: argparse.Namespace) -> tuple[IdentityResolution, dict[str, object]]:
    """Pins (``--pins``) checked against what the model folder and flags say."""
    pins: dict[str, object] = dict(load_pins(args.pins)) if args.pins else {}
    live: dict[str, object] = {}
    if args.model_folder:
        live.update(from_model_folder(args.model_folder, kv_cache_dtype=args.kv_cache_dtype))
    for name, value in (
        ("block_size", args.block_size),
        ("tensor_parallel_size", args.tensor_parallel_size),
        ("pipeline_parallel_size", args.pipeline_parallel_size),
        ("max_model_len", args.max_model_len),
    ):
        if value is not None:
            live[name] = value
    if args.model_folder or args.with_build:
        live["connector"] = CONNECTOR_NAME
        build = build_identity()
        if build is not None:
            live["build"] = build
    return merge_sources(pins, live, live_label="resolved"), pins


def cmd_identity(args: argparse.Namespace) -> int:
    if args.words:  # `identity diff A B`, the same as `identity --diff A B`
        if len(args.words) != 3 or args.words[0] != "diff" or args.diff:
            print("kvp-admin identity: expected `identity diff A B` (or `identity --diff A B`), "
                  f"got {' '.join(args.words)!r}", file=sys.stderr)
            return EXIT_USAGE
        args.diff = args.words[1:]
    if args.diff:
        return cmd_identity_diff(args)
    if args.server:
        return cmd_identity_server(args)
    if args.namespace:
        return cmd_identity_recorded(args)
    try:
        resolution, pins = resolve_cli_identity(args)
    except (IdentityError, ValueError) as exc:
        print(f"kvp-admin identity: {exc}", file=sys.stderr)
        return EXIT_ERROR
    ident = resolution.identity
    if args.json:
        print_json({
            "enabled": resolution.enabled,
            "namespace": ident.namespace if ident else None,
            "lmcache_model_name": ident.lmcache_model_name() if ident else None,
            "fields": ident.as_dict() if ident else None,
            "sources": resolution.sources,
            "problems": resolution.problems,
        })
    else:
        rows = [
            (s.name, getattr(ident, s.name) if ident else pins.get(s.name, "?"),
             resolution.sources.get(s.name, "-"))
            for s in FIELDS
        ]
        print(table(rows, ("field", "value", "source")))
        print()
        print(resolution.summary())
        if ident:
            print(f"lmcache model name: {ident.lmcache_model_name()}")
    return EXIT_OK if resolution.enabled else EXIT_OFF


def _recorded_rows(ident: CacheIdentity) -> list[tuple[str, object]]:
    return [(s.name, getattr(ident, s.name)) for s in FIELDS]


def cmd_identity_recorded(args: argparse.Namespace) -> int:
    """The identity recorded for a namespace under the cache root."""
    root = settings_or_exit().cache_root
    try:
        ident = read_record(root, args.namespace)
    except IdentityError as exc:
        print(f"kvp-admin identity --namespace: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json({"namespace": ident.namespace, "lmcache_model_name": ident.lmcache_model_name(),
                    "fields": ident.as_dict()})
    else:
        print(table(_recorded_rows(ident), ("field", "value")))
        print(f"\nnamespace {ident.namespace} (recorded under {root})")
    return EXIT_OK


def cmd_identity_server(args: argparse.Namespace) -> int:
    """The namespaces of the engines registered with the running server, with their records."""
    settings = settings_or_exit()
    active = active_namespaces_from_server(settings.http_url)
    if active is None:
        print(f"kvp-admin identity --server: the server at {settings.http_url} does not answer",
              file=sys.stderr)
        return EXIT_OFF
    records = list_records(settings.cache_root)
    engines = [(ns, records.get(ns, "no identity record under the cache root"))
               for ns in sorted(active)]
    if args.json:
        print_json({"server": settings.http_url, "engines": [
            {"namespace": ns,
             "fields": rec.as_dict() if isinstance(rec, CacheIdentity) else None,
             "problem": rec if isinstance(rec, str) else None} for ns, rec in engines]})
        return EXIT_OK
    if not engines:
        print(f"no engine is registered with the server at {settings.http_url}")
    for ns, rec in engines:
        print(f"namespace {ns} (registered with {settings.http_url})")
        print(f"  {rec}" if isinstance(rec, str) else table(_recorded_rows(rec), ("field", "value")))
        print()
    return EXIT_OK


def _load_side(spec: str) -> dict[str, object]:
    if NAMESPACE_RE.fullmatch(spec):
        return dict(read_record(settings_or_exit().cache_root, spec).as_dict())
    path = Path(spec)
    if path.is_dir():
        return dict(from_model_folder(path))
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return dict(data.get("fields", data))
    return dict(load_pins(path))


def cmd_identity_diff(args: argparse.Namespace) -> int:
    a_spec, b_spec = args.diff
    try:
        a, b = _load_side(a_spec), _load_side(b_spec)
    except (IdentityError, ValueError, OSError) as exc:
        print(f"kvp-admin identity --diff: {exc}", file=sys.stderr)
        return EXIT_ERROR
    diffs = diff_identities(a, b)
    if args.json:
        print_json({"same": not diffs, "differences": [
            {"field": f, "a": va, "b": vb} for f, va, vb in diffs]})
    elif not diffs:
        print("same identity fields: these configurations share KV (same namespace)")
    else:
        print(f"{len(diffs)} field(s) differ, so the two configurations never share KV:")
        print(table([(f, va, vb) for f, va, vb in diffs], ("field", a_spec, b_spec)))
    return EXIT_OK


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "identity",
        help="resolve the compatibility identity and namespace; explain why two configs differ",
        description="Resolve the cache identity of a model folder and/or a pins file "
        "(configs/<model>/identity.env). Fields found in both must agree, or caching is OFF "
        "(exit 3) and the disagreeing field is named. Example: kvp-admin identity --pins "
        "configs/tiny-llama/identity.env --model-folder /models/.../snapshots/<sha>. "
        "With `diff A B` or --diff A B (pins files, model folders, 'identity --json' outputs or "
        "namespaces recorded under the cache root) it lists the fields that keep two "
        "configurations from sharing KV: the answer to 'why no hits?'. Examples: kvp-admin "
        "identity diff configs/a/identity.env configs/b/identity.env; kvp-admin identity diff "
        "kvp-<old namespace from report> configs/a/identity.env. --namespace NS prints what a "
        "namespace on disk stands for; --server the namespaces of the running server's engines.",
    )
    p.add_argument("words", nargs="*", metavar="diff A B",
                   help="compare two configurations (the same as --diff A B)")
    p.add_argument("--pins", help="identity.env pins file")
    p.add_argument("--model-folder", help="local HF-style model folder (config.json, tokenizer)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="vLLM --kv-cache-dtype; 'auto' resolves to the weights' dtype (default)")
    p.add_argument("--block-size", type=int, help="vLLM --block-size")
    p.add_argument("--tensor-parallel-size", type=int, help="vLLM -tp")
    p.add_argument("--pipeline-parallel-size", type=int, help="vLLM -pp")
    p.add_argument("--max-model-len", type=int, help="vLLM --max-model-len")
    p.add_argument("--with-build", action="store_true",
                   help="add the installed LMCache/vLLM build identity even without a model folder")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two configurations")
    p.add_argument("--namespace", metavar="NS",
                   help="the identity recorded for NS under KVP_CACHE_ROOT/namespaces/")
    p.add_argument("--server", action="store_true",
                   help="the namespaces of the engines registered with the running server")
    add_json(p)
    p.set_defaults(func=cmd_identity)
