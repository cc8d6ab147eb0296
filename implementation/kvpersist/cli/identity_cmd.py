"""``kvp-admin identity``: resolve a configuration's identity and namespace; ``--diff`` explains
field by field why two configurations never share KV (the answer to "why no hits?")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..identity import (
    FIELDS,
    IdentityError,
    IdentityResolution,
    diff_identities,
    load_pins,
    merge_sources,
)
from ..identity_sources import CONNECTOR_NAME, build_identity, from_model_folder
from .common import EXIT_ERROR, EXIT_OFF, EXIT_OK, Subparsers, add_json, print_json, table


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
    if args.diff:
        return cmd_identity_diff(args)
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


def _load_side(spec: str) -> dict[str, object]:
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
        "With --diff A B (pins files, model folders or 'identity --json' outputs) it lists "
        "the fields that keep two configurations from sharing KV: the answer to 'why no hits?'.",
    )
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
    add_json(p)
    p.set_defaults(func=cmd_identity)
