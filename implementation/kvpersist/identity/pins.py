"""Pins files (``configs/<model>/identity.env``): ``KVP_FIELD=value`` lines that fix identity fields.

Invariant: a pins file is read completely or not at all; a malformed line, an unknown ``KVP_*``
key or a field pinned twice raises :class:`IdentityError` naming the line, so a typo never
silently drops a pin.
"""

from __future__ import annotations

from pathlib import Path

from ..config.envfile import EnvLineError, parse_env_lines
from .fields import BY_ENV, FIELDS, CacheIdentity, IdentityError


def parse_pins_text(text: str, *, source: str = "<pins>") -> dict[str, str]:
    """Parse an ``identity.env`` body (``KVP_FIELD=value`` lines) into field-name → raw value.

    Comments (``#``), blank lines, an optional ``export`` and matching quotes are accepted.
    Unknown ``KVP_*`` keys and malformed lines raise IdentityError naming the line, so a typo
    never silently drops a pin.
    """
    out: dict[str, str] = {}
    try:
        assignments = list(parse_env_lines(text, source))
    except EnvLineError as exc:
        raise IdentityError(exc.location, f"expected KEY=value, got {exc.raw!r}") from None
    for lineno, key, value in assignments:
        spec = BY_ENV.get(key)
        if spec is None:
            known = ", ".join(sorted(BY_ENV))
            raise IdentityError(f"{source}:{lineno}", f"unknown key {key!r}; known keys: {known}")
        if spec.name in out:
            raise IdentityError(spec.name, f"pinned twice in {source} (line {lineno})")
        out[spec.name] = value
    return out


def load_pins(path: str | Path) -> dict[str, str]:
    """Read a pins file; a missing or unreadable file raises IdentityError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise IdentityError("pins", f"cannot read {p}: {exc.strerror or exc}") from None
    return parse_pins_text(text, source=str(p))


def format_pins(identity: CacheIdentity) -> str:
    """An ``identity.env`` body that pins every field of ``identity``."""
    lines = [f"# kvpersist identity pins; namespace {identity.namespace}"]
    for spec in FIELDS:
        lines.append(f"{spec.env}={getattr(identity, spec.name)}")
    return "\n".join(lines) + "\n"
