"""Whether a root of a several-root tier is the device the tier wrote, and whether it answers.

Each root carries a marker (``.kvpersist-state/root-id``, a random id written on first use), and
the primary root keeps the register of every root's id (``.kvpersist-state/roots.json``).

Invariants
----------
* A root the register knows is used only when its marker holds the registered id: a mount
  point whose device is not mounted (an empty directory on the system disk) or another device
  mounted in its place is never written to or read from as the tier.
* A root the register does not know is adopted: its marker's id if it has one (a root moved to
  another path), else a new one written now (a new device), and recorded.
* :func:`probe` does only small operations on the root itself (a stat, the marker's read, a
  one-byte write and unlink in the state directory); a full device (ENOSPC, EDQUOT) is not a
  fault: its files still serve, and stores on it are refused as ever.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from pathlib import Path

from ..atomic import write_text_atomic
from .layout import STATE_DIR

MARKER = "root-id"
REGISTER = "roots.json"
#: Errors of a probe's write that say the device is full, not faulty.
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class RootRefused(Exception):
    """The root is not the device the tier wrote (see module invariants)."""


def marker_path(root: Path) -> Path:
    return root / STATE_DIR / MARKER


def read_marker(root: Path) -> str | None:
    try:
        text = marker_path(root).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    return text or None


class RootRegister:
    """The ids of a tier's roots, kept in the primary root (see module invariants)."""

    def __init__(self, primary: Path) -> None:
        self.path = primary / STATE_DIR / REGISTER

    def load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # unreadable: every root is taken by its own marker
        roots = data.get("roots") if isinstance(data, dict) else None
        if not isinstance(roots, dict):
            return {}
        return {str(k): str(v) for k, v in roots.items()}

    def record(self, root: str, identity: str) -> None:
        roots = self.load()
        if roots.get(root) == identity:
            return
        roots[root] = identity
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps({"roots": roots}, indent=1, sort_keys=True))


def claim(root: Path, register: RootRegister) -> str:
    """The id of ``root`` under the register's rules; raises :class:`RootRefused` for a root
    whose marker is missing or differs from the registered one, ``OSError`` when the root cannot
    be read or written."""
    known = register.load().get(str(root))
    found = read_marker(root) if root.is_dir() else None
    if known is not None:
        if found is None:
            raise RootRefused(f"{root} has no root marker ({STATE_DIR}/{MARKER}) although this "
                              "tier wrote it: its device is not mounted there")
        if found != known:
            raise RootRefused(f"{root} holds root {found}, not {known} that this tier wrote: "
                              "another device is mounted there")
        return known
    identity = found or uuid.uuid4().hex
    if found is None:
        (root / STATE_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
        write_text_atomic(marker_path(root), identity + "\n")
    register.record(str(root), identity)
    return identity


def probe(root: Path, identity: str) -> str | None:
    """Why ``root`` cannot serve now, or None when it can (see module invariants)."""
    try:
        if not root.is_dir():
            return f"{root} is not a directory any more"
        replaced = _replaced(root, identity)
    except OSError as exc:
        return f"{root} cannot be read ({exc.strerror or exc})"
    if replaced is not None:
        return replaced
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return f"{root} is read-only"
    except OSError as exc:
        return f"{root} cannot be read ({exc.strerror or exc})"
    scratch = root / STATE_DIR / f".probe-{os.getpid()}"
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        os.unlink(scratch)
    except OSError as exc:
        if exc.errno in FULL:
            with contextlib.suppress(OSError):
                os.unlink(scratch)
            return None
        if exc.errno == errno.EROFS:
            # remounted read-only between the statvfs above and this write: the same fault
            return f"{root} is read-only"
        with contextlib.suppress(OSError):
            # unmounted between the marker's read and the write: say so, not just "ENOENT"
            replaced = _replaced(root, identity)
        return replaced or f"{root} cannot be written ({exc.strerror or exc})"
    return None


def _replaced(root: Path, identity: str) -> str | None:
    """Why ``root`` is not the device ``identity`` any more, or None while its marker holds it."""
    found = read_marker(root)
    if found == identity:
        return None
    return (f"{root} no longer holds root {identity} "
            f"({'no marker' if found is None else 'root ' + found}): unmounted or replaced")
