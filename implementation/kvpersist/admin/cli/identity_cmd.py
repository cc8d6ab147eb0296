"""``kvp-admin identity``: resolve a configuration's identity and namespace; ``diff`` explains
field by field why two configurations never share KV (the answer to "why no hits?")."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from ...identity.engine_flags import (
    EngineFlagsError,
    IdentityFlags,
    add_engine_flags,
    hf_overrides_of,
    identity_flags,
    mm_processor_kwargs_of,
    names_a_draft,
)
from ...identity.fields import NO_DRAFT
from ...identity.records import list_records, read_record
from ...identity.sources import (
    CONNECTOR_NAME,
    build_identity,
    chat_template_digest,
    from_model_folder,
    hf_snapshot_origin,
    read_model_config,
    text_config,
)
from ...identity.weights_digest import FileDigestCache, default_cache_dir, folder_bytes, weights_digest
from .. import vllm_block_size, vllm_quantization
from ..pins_writer import (
    TOKENIZER_FILES,
    PinsError,
    check_model_folder,
    overrides,
    render_pins,
    write_pins,
)
from ..progress import Progress, stderr_progress
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
    #: the recipe runs a draft model, whose digest only the engine computes: the namespace
    #: shown is the one without it
    draft_named: bool = False


def engine_flags(args: argparse.Namespace) -> IdentityFlags:
    """The recipe's flags (``--vllm-args``), each replaced by the same flag given explicitly."""
    recipe = identity_flags(args.vllm_args) if args.vllm_args else IdentityFlags()
    explicit = {f.name: getattr(args, f.name) for f in dataclasses.fields(IdentityFlags)
                if f.name != "model" and getattr(args, f.name, None) is not None}
    return dataclasses.replace(recipe, **explicit)


def folder_text_config(folder: str) -> Mapping[str, Any]:
    """The text part of the model folder's config.json (empty when it cannot be read: the
    field is then resolved by the rest of the pins writer, which reports the folder's error)."""
    try:
        return text_config(read_model_config(Path(folder) / "config.json"))
    except ValueError:
        return {}


def model_folder(args: argparse.Namespace, flags: IdentityFlags) -> str | None:
    """``--model-folder``, else the recipe's model when it is a local folder."""
    return args.model_folder or (flags.model if flags.model and Path(flags.model).is_dir()
                                 else None)


def resolve_cli_identity(args: argparse.Namespace) -> CliResolution:
    """Pins (``--pins``) checked against what the model folder, the recipe's vLLM arguments
    (``--vllm-args``), the explicit flags and ``--set`` say (later ones win)."""
    pins: dict[str, object] = dict(load_pins(args.pins)) if args.pins else {}
    flags = engine_flags(args)
    folder = model_folder(args, flags)
    live: dict[str, object] = {}
    if folder:
        with digest_progress(Path(folder)) as progress:
            live.update(from_model_folder(
                folder, kv_cache_dtype=flags.kv_cache_dtype or "auto",
                dtype=flags.dtype or "auto", quantization=flags.quantization,
                hf_overrides=hf_overrides_of(flags),
                mm_processor_kwargs=mm_processor_kwargs_of(flags),
                resolve_quantization=vllm_quantization.resolve, progress=progress))
    template_text = None
    if flags.chat_template:
        try:
            template_text = Path(flags.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise PinsError(f"cannot read --chat-template {flags.chat_template}: "
                            f"{exc.strerror}") from None
        live["chat_template_sha256"] = chat_template_digest(template_text)
    for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len"):
        value = getattr(flags, name)
        if name == "block_size" and folder:  # the engine's platform may override the request
            value = vllm_block_size.resolve(value, folder_text_config(folder))
        if value is not None:
            live[name] = value
    # the engine's alone (pins leave it out): 'none' unless a draft model runs, and then the
    # engine adds its digest to the namespace shown here
    live["draft_sha256"] = NO_DRAFT
    live.update(overrides(args.set or []))
    if folder or args.with_build:
        live["connector"] = CONNECTOR_NAME
        build = build_identity()
        if build is not None:
            live["build"] = build
    return CliResolution(merge_sources(pins, live, live_label="resolved"), pins, live,
                         Path(folder) if folder else None, template_text,
                         draft_named=names_a_draft(flags))


#: What ``kvp-admin identity`` says when the recipe runs a draft model.
DRAFT_NOTE = ("the recipe's --speculative-config runs a draft model: the engine adds its digest "
              "(draft_sha256) to the namespace, so the engine's namespace differs from the one "
              "shown; the pins leave it out")


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


def _resolved_or_report(args: argparse.Namespace, command: str) -> CliResolution | None:
    """:func:`resolve_cli_identity`, or None after printing why it could not be resolved."""
    try:
        return resolve_cli_identity(args)
    except (IdentityError, ValueError) as exc:
        print(f"kvp-admin {command}: {exc}", file=sys.stderr)
        return None


@contextlib.contextmanager
def digest_progress(folder: Path) -> Iterator[Callable[[int], None]]:
    """A progress callback (bytes read per step, from several threads) for digesting
    ``folder``: a bar on a terminal while files are read, nothing when the cache answers."""
    lock = threading.Lock()
    done = 0
    bar: Progress | None = None
    started = False

    def step(nbytes: int) -> None:
        nonlocal done, bar, started
        with lock:
            if not started:
                started = True
                bar = stderr_progress("digesting the model folder", folder_bytes(folder),
                                      unit="bytes")
            done += nbytes
            if bar is not None:
                bar(done)
    try:
        yield step
    finally:
        if bar is not None:
            bar.close()


def local_folder_fields(args: argparse.Namespace) -> list[str]:
    """``--set`` pairs for a model folder outside the Hugging Face cache layout, which has no
    revision to read: the revisions are the folder's weights digest cut to 40 hex digits
    (:mod:`kvpersist.identity.weights_digest`), the ids ``local/<folder name>``; a field the
    operator set is kept."""
    folder = model_folder(args, engine_flags(args))
    if not folder or not Path(folder).is_dir() or hf_snapshot_origin(Path(folder)) is not None:
        return []
    path = Path(folder).resolve()
    given = overrides(args.set or [])
    wanted = ["model_id", "model_revision"]
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        wanted += ["tokenizer_id", "tokenizer_revision"]
    if all(name in given for name in wanted):
        return []
    digest = ""
    if any(name.endswith("revision") and name not in given for name in wanted):
        with digest_progress(path) as progress:
            digest = weights_digest(path, FileDigestCache(default_cache_dir()), progress)[:40]
        print(f"note: {path} is not a Hugging Face snapshot: its revision is a content digest "
              f"of the folder ({digest}); any changed file gives another namespace",
              file=sys.stderr)
    values = {"model_id": f"local/{path.name}", "tokenizer_id": f"local/{path.name}",
              "model_revision": digest, "tokenizer_revision": digest}
    return [f"{name}={values[name]}" for name in wanted if name not in given]


def cmd_write_pins(args: argparse.Namespace) -> int:
    try:
        args.set = [*(args.set or []), *local_folder_fields(args)]
    except (PinsError, OSError) as exc:
        print(f"kvp-admin identity write-pins: {exc}; nothing written", file=sys.stderr)
        return EXIT_ERROR
    found = _resolved_or_report(args, "identity write-pins")
    if found is None:
        return EXIT_ERROR
    ident = found.resolution.identity
    target = Path(args.file)
    if found.model_folder is None:
        print("kvp-admin identity write-pins: give --model-folder (or a model folder as the "
              "first of --vllm-args); nothing written", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_model_folder(found.model_folder, chat_template=found.chat_template_text)
    except (PinsError, EngineFlagsError) as exc:
        print(f"kvp-admin identity write-pins: {exc}; nothing written", file=sys.stderr)
        return EXIT_ERROR
    if ident is None:
        print(table(_field_rows(found), ("field", "value", "source")), file=sys.stderr)
        print(f"\nkvp-admin identity write-pins: the identity is incomplete, nothing written: "
              f"{'; '.join(found.resolution.problems)}. Add the engine flags (--vllm-args "
              "\"<the recipe's vLLM arguments>\", or --block-size ...) or --set FIELD=VALUE",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        outcome = write_pins(target, render_pins(ident, origin=str(found.model_folder)),
                             force=args.force)
    except (PinsError, EngineFlagsError, OSError) as exc:
        print(f"kvp-admin identity write-pins: {exc}; nothing written", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print_json({"pins": str(target), "outcome": outcome, "namespace": ident.namespace,
                    "fields": ident.as_dict()})
    else:
        print(f"{outcome} {target}: namespace {ident.namespace}")
        if found.draft_named:
            print(f"note: {DRAFT_NOTE}")
    return EXIT_OK


def cmd_identity_resolve(args: argparse.Namespace) -> int:
    found = _resolved_or_report(args, "identity")
    if found is None:
        return EXIT_ERROR
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
            "notes": [DRAFT_NOTE] if found.draft_named else [],
        })
    else:
        print(table(_field_rows(found), ("field", "value", "source")))
        print()
        print(resolution.summary())
        if ident:
            print(f"lmcache model name: {ident.lmcache_model_name()}")
        if found.draft_named:
            print(f"note: {DRAFT_NOTE}")
    return EXIT_OK if resolution.enabled else EXIT_OFF


def _recorded_rows(ident: CacheIdentity) -> list[tuple[str, object]]:
    return [(s.name, getattr(ident, s.name)) for s in FIELDS]


def cmd_identity_recorded(args: argparse.Namespace) -> int:
    """The identity recorded for a namespace under the cache root."""
    root = settings_or_exit().cache_root
    try:
        ident = read_record(root, args.namespace)
    except IdentityError as exc:
        print(f"kvp-admin identity show: {exc}", file=sys.stderr)
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
        print(f"kvp-admin identity server: the server at {settings.http_url} does not answer",
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
    """The fields ``spec`` names (a namespace's record, a model folder, a JSON of fields or a
    pins file).  A folder or a pins file that leaves ``build`` to the engine gets the build this
    installation's engine would add, as it would at run time: a pins file then differs from a
    namespace in ``build`` only when the installed versions did change."""
    if NAMESPACE_RE.fullmatch(spec):
        return dict(read_record(settings_or_exit().cache_root, spec).as_dict())
    path = Path(spec)
    if path.is_dir():
        side = dict(from_model_folder(path))
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        return dict(data.get("fields", data))
    else:
        side = dict(load_pins(path))
    installed = build_identity()
    if "build" not in side and installed is not None:
        side["build"] = installed
    return side


def cmd_identity_diff(args: argparse.Namespace) -> int:
    a_spec, b_spec = args.a, args.b
    try:
        a, b = _load_side(a_spec), _load_side(b_spec)
    except (IdentityError, ValueError, OSError) as exc:
        print(f"kvp-admin identity diff: {exc}", file=sys.stderr)
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


#: The subcommands of ``kvp-admin identity``; without one, ``resolve`` is meant.
SUBCOMMANDS = ("resolve", "write-pins", "diff", "show", "server")
def identity_argv(argv: Sequence[str]) -> list[str]:
    """``kvp-admin identity ...`` arguments with the subcommand made explicit: none given means
    ``resolve`` (argparse names the choices when a word is not one)."""
    words = list(argv)
    if words and (not words[0].startswith("-") or words[0] in ("-h", "--help")):
        return words
    return ["resolve", *words]


def _source_flags() -> argparse.ArgumentParser:
    """What ``resolve`` and ``write-pins`` resolve an identity from (one definition)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--pins", help="identity.env pins file (configs/<model>/identity.env)")
    p.add_argument("--model-folder", help="local HF-style model folder (config.json, tokenizer)")
    p.add_argument("--vllm-args", metavar="ARGS",
                   help="the recipe's vLLM arguments as one string (what kvp-vllm gets): block "
                   "size, -tp, -pp, --max-model-len, --dtype, --kv-cache-dtype and --chat-template "
                   "are read from it (vLLM's defaults for -tp/-pp), and a leading model folder")
    add_engine_flags(p)  # the pins writer's own flags: each replaces the recipe's
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="give a field no source has, e.g. --set KVP_MODEL_ID=org/name for a "
                   "folder outside the HF cache layout (repeatable)")
    p.add_argument("--with-build", action="store_true",
                   help="add the installed LMCache/vLLM build identity even without a model folder")
    return p


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "identity",
        help="resolve the compatibility identity and namespace; explain why two configs differ",
        description="The cache identity: the fields that decide whether KV can be shared, and "
        "the namespace kvp-<32 hex> they form. Subcommands: resolve (the default), write-pins, "
        "diff, show, server; `kvp-admin identity SUBCOMMAND --help` for each.",
        epilog="Examples: kvp-admin identity --vllm-args \"<snapshot folder> -tp 4 --block-size "
        "16\" (resolve, as the engine would); kvp-admin identity write-pins "
        "configs/<model>/identity.env --vllm-args \"<the recipe's vLLM arguments>\"; kvp-admin "
        "identity diff a.env b.env (why no hits?); kvp-admin identity show kvp-<ns>; kvp-admin "
        "identity server.")
    commands = p.add_subparsers(dest="identity_command", required=True, metavar="SUBCOMMAND")
    sources = _source_flags()
    r = commands.add_parser(
        "resolve", parents=[sources],
        help="resolve an identity from pins, a model folder and the recipe's flags",
        description="Resolve the cache identity of a model folder and/or a pins file. Fields "
        "found in both must agree, or caching is OFF (exit 3) and the disagreeing field is "
        "named. Example: kvp-admin identity resolve --pins configs/tiny-llama/identity.env "
        "--model-folder /models/.../snapshots/<sha>.")
    add_json(r)
    r.set_defaults(func=cmd_identity_resolve)
    w = commands.add_parser(
        "write-pins", parents=[sources],
        help="write a complete, commented identity.env for a model and recipe",
        description="Write the pins for a new model from the same arguments the launcher gets, "
        "so pins and engine agree: kvp-admin identity write-pins configs/<model>/identity.env "
        "--vllm-args \"<the recipe's vLLM arguments, model folder first>\". A field no source "
        "has is named, and given with --set FIELD=VALUE. Needs a model folder; refuses to "
        "replace a different FILE without --force.")
    w.add_argument("file", metavar="FILE", help="the identity.env to write")
    w.add_argument("--force", action="store_true", help="replace a different FILE")
    add_json(w)
    w.set_defaults(func=cmd_write_pins)
    d = commands.add_parser(
        "diff", help="the fields that keep two configurations from sharing KV",
        description="Compare two configurations: pins files, model folders, 'identity --json' "
        "outputs or namespaces recorded under the cache root. The answer to 'why no hits?'. "
        "Examples: kvp-admin identity diff configs/a/identity.env configs/b/identity.env; "
        "kvp-admin identity diff kvp-<old namespace from report> configs/a/identity.env.")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    add_json(d)
    d.set_defaults(func=cmd_identity_diff)
    n = commands.add_parser(
        "show", help="what a namespace on disk stands for",
        description="The identity recorded for NS under KVP_CACHE_ROOT/namespaces/.")
    n.add_argument("namespace", metavar="NS")
    add_json(n)
    n.set_defaults(func=cmd_identity_recorded)
    v = commands.add_parser(
        "server", help="the namespaces of the engines registered with the running server",
        description="The namespaces the running LMCache server lists for its engines, with the "
        "identity recorded for each.")
    add_json(v)
    v.set_defaults(func=cmd_identity_server)
