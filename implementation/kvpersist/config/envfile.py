"""``KEY=value`` files (``identity.env`` pins, the site file ``kvpersist.env``), parsed one way.

Invariant: every non-blank, non-comment line is ``[export ]KEY=value`` (matching surrounding
quotes are stripped); anything else raises :class:`EnvLineError` naming the line, so a typo is
reported and never silently skipped.
"""

from __future__ import annotations

from collections.abc import Iterator


class EnvLineError(ValueError):
    def __init__(self, source: str, lineno: int, raw: str) -> None:
        super().__init__(f"{source}:{lineno}: expected KEY=value, got {raw!r}")
        self.location = f"{source}:{lineno}"
        self.raw = raw


def parse_env_lines(text: str, source: str) -> Iterator[tuple[int, str, str]]:
    """Yield (line number, key, value) for each assignment in ``text``."""
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        if "=" not in line:
            raise EnvLineError(source, lineno, raw)
        key, value = (part.strip() for part in line.split("=", 1))
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        yield lineno, key, value
