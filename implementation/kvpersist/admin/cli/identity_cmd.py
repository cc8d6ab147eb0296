"""``kvp-admin identity``: resolve a configuration's identity and namespace; ``--diff`` explains
field by field why two configurations never share KV (the answer to "why no hits?")."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
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
from ...identity.sources import (
    CONNECTOR_NAME,
    build_identity,
    chat_template_digest,
    from_model_folder,
    resolved_kv_cache_dtype,
)
from ..pins_writer import (
    IdentityFlags,
    PinsError,
    check_model_folder,
    identity_flags,
    overrides,
    render_pins,
    write_pins,
)
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


@dataclass(frozen=True)
class CliResolution:
    resolution: IdentityResolution
    pins: dict[str, object]
    live: dict[str, object]
    model_folder: Path | None
    chat_template_text: str | None


def _kv_cache_dtype(args: argparse.Namespace, flags: IdentityFlags) -> str:
    """The KV-cache dtype the flags give (``--kv-cache-dtype`` here, else the recipe's), by
    :func:`~kvpersist.identity.sources.resolved_kv_cache_dtype` against ``--dtype``; ``auto``
    when neither says (then the weights' dtype from config.json decides)."""
    given = args.kv_cache_dtype if args.kv_cache_dtype not in (None, "auto") \
        else flags.kv_cache_dtype
    model = None if flags.dtype is None else str(flags.dtype)
    resolved = resolved_kv_cache_dtype(None if given is None else str(given), model)
    return resolved or "auto"


def resolve_cli_identity(args: argparse.Namespace) -> CliResolution:
    """Pins (``--pins``) checked against what the model folder, the recipe's vLLM arguments
    (``--vllm-args``), the explicit flags and ``--set`` say (later ones win)."""
    pins: dict[str, object] = dict(load_pins(args.pins)) if args.pins else {}
    flags = identity_flags(args.vllm_args) if args.vllm_args else IdentityFlags()
    folder = args.model_folder or (flags.model if flags.model and Path(flags.model).is_dir()
                                   else None)
    live: dict[str, object] = {}
    if folder:
        live.update(from_model_folder(folder, kv_cache_dtype=_kv_cache_dtype(args, flags)))
    template_text = None
    if flags.chat_template:
        try:
            template_text = Path(flags.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise PinsError(f"cannot read --chat-template {flags.chat_template}: "
                            f"{exc.strerror}") from None
        live["chat_template_sha256"] = chat_template_digest(template_text)
    for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len"):
        for value in (getattr(flags, name), getattr(args, name)):
            if value is not None:
                live[name] = value
    live.update(overrides(args.set or []))
    if folder or args.with_build:
        live["connector"] = CONNECTOR_NAME
        build = build_identity()
        if build is not None:
            live["build"] = build
    return CliResolution(merge_sources(pins, live, live_label="resolved"), pins, live,
                         Path(folder) if folder else None, template_text)


def _field_rows(found: CliResolution) -> list[tuple[str, object, str]]:
    """Every field with the value resolved for it, even when the identity is incomplete."""
    ident = found.resolution.identity
    rows = []
    for spec in FIELDS:
        if ident is not None:
            rows.append((spec.name, getattr(ident, spec.name),
                         found.resolution.sources.get(spec.name, "-")))
            continue
        pin, live = found.pins.get(spec.name), found.live.get(spec.name)
        if pin is None and live is None:
            rows.append((spec.name, f"MISSING ({spec.env})", "-"))
        elif pin is not None and live is not None and str(pin) != str(live):
            rows.append((spec.name, f"pin {pin} / resolved {live}", "conflict?"))
        else:
            rows.append((spec.name, pin if pin is not None else live,
                         "pin" if live is None else "resolved" if pin is None else "both"))
    return rows


def cmd_write_pins(args: argparse.Namespace, found: CliResolution) -> int:
    ident = found.resolution.identity
    target = Path(args.write_pins)
    if found.model_folder is None:
        print("kvp-admin identity --write-pins: give --model-folder (or a model folder as the "
              "first of --vllm-args); nothing written", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_model_folder(found.model_folder, chat_template=found.chat_template_text)
    except PinsError as exc:
        print(f"kvp-admin identity --write-pins: {exc}; nothing written", file=sys.stderr)
        return EXIT_ERROR
    if ident is None:
        print(table(_field_rows(found), ("field", "value", "source")), file=sys.stderr)
        print(f"\nkvp-admin identity --write-pins: the identity is incomplete, nothing written: "
              f"{'; '.join(found.resolution.problems)}. Add the engine flags (--vllm-args "
              "\"<the recipe's vLLM arguments>\", or --block-size ...) or --set FIELD=VALUE",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        outcome = write_pins(target, render_pins(ident, origin=str(found.model_folder)),
                             force=args.force)
    except (PinsError, OSError) as exc:
        print(f"kvp-admin identity --write-pins: {exc}; nothing written", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json({"pins": str(target), "outcome": outcome, "namespace": ident.namespace,
                    "fields": ident.as_dict()})
    else:
        print(f"{outcome} {target}: namespace {ident.namespace}")
    return EXIT_OK


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
        found = resolve_cli_identity(args)
    except (IdentityError, ValueError) as exc:
        print(f"kvp-admin identity: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.write_pins:
        return cmd_write_pins(args, found)
    resolution = found.resolution
    ident = resolution.identity
    if args.json:
        print_json({
            "enabled": resolution.enabled,
            "namespace": ident.namespace if ident else None,
            "lmcache_model_name": ident.lmcache_model_name() if ident else None,
            "fields": ident.as_dict() if ident else None,
            "resolved": {row[0]: row[1] for row in _field_rows(found)},
            "missing": [s.name for s in FIELDS
                        if s.name not in found.pins and s.name not in found.live],
            "sources": resolution.sources,
            "problems": resolution.problems,
        })
    else:
        print(table(_field_rows(found), ("field", "value", "source")))
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
        "namespace on disk stands for; --server the namespaces of the running server's engines. "
        "Writing the pins for a new model: kvp-admin identity --vllm-args \"<the recipe's vLLM "
        "arguments, model folder first>\" --write-pins configs/<model>/identity.env (the same "
        "arguments the launcher gets, so pins and engine agree); a field no source has is "
        "named, and given with --set FIELD=VALUE.",
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
    p.add_argument("--vllm-args", metavar="ARGS",
                   help="the recipe's vLLM arguments as one string (what kvp-vllm gets): block "
                   "size, -tp, -pp, --max-model-len, --dtype, --kv-cache-dtype and --chat-template "
                   "are read from it, and a leading model folder too")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="give a field no source has, e.g. --set KVP_MODEL_ID=org/name for a "
                   "folder outside the HF cache layout (repeatable)")
    p.add_argument("--write-pins", metavar="FILE",
                   help="write a complete, commented identity.env from the resolved identity "
                   "(needs a model folder; refuses to replace a different FILE without --force)")
    p.add_argument("--force", action="store_true", help="with --write-pins: replace FILE")
    p.add_argument("--with-build", action="store_true",
                   help="add the installed LMCache/vLLM build identity even without a model folder")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two configurations")
    p.add_argument("--namespace", metavar="NS",
                   help="the identity recorded for NS under KVP_CACHE_ROOT/namespaces/")
    p.add_argument("--server", action="store_true",
                   help="the namespaces of the engines registered with the running server")
    add_json(p)
    p.set_defaults(func=cmd_identity)
