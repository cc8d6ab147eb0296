"""Writing ``configs/<model>/identity.env`` from a model folder and the recipe's vLLM arguments.

Invariants
----------
* The engine flags that enter the identity (block size, TP, PP, max model length, dtype, KV-cache
  dtype, chat template) are read from the *same* argument list the launcher hands to vLLM
  (:func:`kvpersist.identity.engine_flags.identity_flags`), so the pins and the engine cannot drift apart.
* A pins file is written only from a complete identity, atomically, and never over a different
  file unless forced; an identical file is left as it is.  The build and the weights digest
  are left to the engine: pinning the build would turn caching off at every upgrade, and
  pinning the weights digest would turn it off when the weights in the folder are replaced,
  where leaving it to the engine gives them a namespace of their own without re-pinning.
* A model folder is checked before anything is written: readable, with ``config.json``, a
  tokenizer and, when it has one, a chat template that renders a short conversation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..atomic import write_text_atomic
from ..identity import FIELDS, CacheIdentity

#: Files any one of which makes a folder a tokenizer folder (as transformers loads them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Fields the pins file leaves to the running engine.
ENGINE_ONLY = ("build", "weights_sha256", "draft_sha256")


class PinsError(ValueError):
    """The pins cannot be written; the message says why and what to do."""



def check_model_folder(folder: Path, *, chat_template: str | None = None) -> None:
    """Raise :class:`PinsError` unless ``folder`` is a readable model folder with a tokenizer
    whose chat template (``chat_template`` text, else the folder's own) renders."""
    from ..identity.sources import read_chat_template

    if not folder.is_dir():
        raise PinsError(f"model folder {folder} does not exist or is not a directory")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise PinsError(f"model folder {folder} is not readable by this account")
    if not (folder / "config.json").is_file():
        raise PinsError(f"{folder} has no config.json; point --model-folder at the snapshot "
                        "folder (…/snapshots/<sha>)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise PinsError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); the "
                        "tokenizer is part of the identity")
    try:
        template = chat_template if chat_template is not None else read_chat_template(folder)
    except ValueError as exc:
        raise PinsError(str(exc)) from None
    if template is not None:
        render_check(template)


def render_check(template: str) -> None:
    """Render ``template`` on a two-turn chat, as vLLM's chat endpoint would; raise
    :class:`PinsError` with jinja's message when it cannot."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
    try:
        env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                         bos_token="", eos_token="")
    except jinja2.TemplateError as exc:
        raise PinsError(f"the chat template cannot be rendered: {type(exc).__name__}: {exc}"
                        ) from None


def render_pins(identity: CacheIdentity, *, origin: str) -> str:
    """A complete, commented ``identity.env`` for ``identity`` (build left to the engine)."""
    values = identity.as_dict()
    lines = [
        # the earlier spelling of `identity write-pins`, kept: a rewrite must stay "unchanged"
        f"# Identity pins written by `kvp-admin identity write-pins` from {origin}.",
        f"# Namespace: {identity.namespace} (with this build: {values.get('build')}).",
        "# Every field must agree with the running engine, or the connector turns caching off",
        "# and names the field; `kvp-admin identity diff` compares two configurations.",
    ]
    for spec in FIELDS:
        if spec.name in ENGINE_ONLY or spec.name not in values:
            continue  # an optional field at its earlier value: left out, as before it existed
        lines += [f"# {spec.doc}", f"{spec.env}={values[spec.name]}"]
    lines += ["# KVP_BUILD is left to the engine (kvpersist format + LMCache + vLLM versions); "
              "pin it to turn", "# caching off, instead of starting a new namespace, when the "
              "installed build changes.",
              "# KVP_WEIGHTS_SHA256 is left to the engine, which digests the model folder's "
              "bytes at start: weights", "# replaced in the folder get a namespace of their own; "
              "pin it (`kvp-admin identity --json`", "# shows it) to turn caching off instead.",
              ""]
    return "\n".join(lines)


def write_pins(path: Path, text: str, *, force: bool) -> str:
    """Write ``text`` to ``path``; returns ``written``, ``replaced`` or ``unchanged``.  A
    different existing file is replaced only with ``force``."""
    if path.exists():
        if not path.is_file():
            raise PinsError(f"{path} exists and is not a file")
        if path.read_text(encoding="utf-8", errors="replace") == text:
            return "unchanged"
        if not force:
            raise PinsError(f"{path} exists with other content; compare with `kvp-admin identity "
                            f"diff {path} <model folder>`, or pass --force to replace it")
        write_text_atomic(path, text, mode=0o644)
        return "replaced"
    if not path.parent.is_dir():
        raise PinsError(f"the folder of {path} does not exist")
    write_text_atomic(path, text, mode=0o644)
    return "written"


def overrides(pairs: Sequence[str]) -> dict[str, str]:
    """``--set KVP_MODEL_ID=org/name`` (or ``model_id=org/name``) pairs as field -> value."""
    by_env: Mapping[str, str] = {f.env: f.name for f in FIELDS}
    names = {f.name for f in FIELDS}
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        field = by_env.get(key.strip(), key.strip())
        if not sep or field not in names:
            raise PinsError(f"--set {pair!r}: expected FIELD=VALUE with a field such as "
                            f"KVP_MODEL_ID or model_id (known: {', '.join(sorted(by_env))})")
        out[field] = value.strip()
    return out
