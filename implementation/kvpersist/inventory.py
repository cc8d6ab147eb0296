"""What is on disk under ``KVP_CACHE_ROOT``, measured from the disk itself (names and sizes only).

Invariants
----------
* Read-only: building an inventory never changes, opens or follows anything.
* Symlinks are never followed: a symlink anywhere in the tree is reported as ``foreign`` and
  never descended into, so nothing outside the root is ever counted or listed.
* Every regular file under the root falls in exactly one class:
  ``live`` (a cache file whose name parses: kvpersist ``.kvp`` or nixl_store_dynamic ``.bin``),
  ``temp`` (an unpublished ``*.kvp.tmp.*`` leftover), ``quarantine`` (under ``quarantine/``),
  ``unparsable`` (a cache suffix whose name does not parse) or ``foreign`` (anything else:
  the server's pid/log/lock files, operator files).  Only the first three are ever proposed
  for deletion; ``unparsable`` only on explicit request, ``foreign`` never.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .l2_format import (
    SUFFIX,
    TMP_MARK,
    FormatError,
    KeyFields,
    model_name_from_safe,
    parse_name,
    split_model_name,
)
from .l2_store import QUARANTINE_DIR

NIXL_SUFFIX = ".bin"
CACHE_SUFFIXES = (SUFFIX, NIXL_SUFFIX)
CLASSES = ("live", "temp", "quarantine", "unparsable", "foreign")
class InventoryError(RuntimeError):
    """The root cannot be inventoried (missing, not a directory, unreadable)."""


class CacheFile(NamedTuple):
    """One file under the root.  ``model_name`` (LMCache's) is set for live files only."""

    dir: str
    name: str
    cls: str
    size: int
    mtime: float
    model_name: str = ""

    @classmethod
    def at(cls, path: Path, kind: str, size: int, mtime: float, model_name: str = "") -> CacheFile:
        return cls(str(path.parent), path.name, kind, size, mtime, model_name)

    @property
    def path(self) -> Path:
        return Path(self.dir, self.name)

    @property
    def key(self) -> KeyFields | None:
        """The full object key of a live file (parsed on demand)."""
        if self.cls != "live":
            return None
        name = self.name
        if name.endswith(NIXL_SUFFIX):
            name = name[: -len(NIXL_SUFFIX)] + SUFFIX
        try:
            return parse_name(name)
        except FormatError:
            return None

    @property
    def namespace(self) -> str:
        return split_model_name(self.model_name)[0] if self.model_name else ""

    @property
    def model_id(self) -> str:
        return split_model_name(self.model_name)[1] if self.model_name else ""


@dataclass
class NamespaceUsage:
    namespace: str
    model_ids: set[str] = field(default_factory=set)
    files: int = 0
    bytes: int = 0
    last_access: float = 0.0


@dataclass
class Inventory:
    root: Path
    files: list[CacheFile]
    errors: list[str]
    seconds: float

    def by_class(self) -> dict[str, tuple[int, int]]:
        counts = dict.fromkeys(CLASSES, 0)
        sizes = dict.fromkeys(CLASSES, 0)
        for f in self.files:
            counts[f.cls] += 1
            sizes[f.cls] += f.size
        return {c: (counts[c], sizes[c]) for c in CLASSES}

    def namespaces(self) -> dict[str, NamespaceUsage]:
        per_model: dict[str, list[float]] = {}  # model name → [files, bytes, last access]
        for f in self.files:
            if f.cls != "live":
                continue
            acc = per_model.get(f.model_name)
            if acc is None:
                per_model[f.model_name] = [1, f.size, f.mtime]
            else:
                acc[0] += 1
                acc[1] += f.size
                if f.mtime > acc[2]:
                    acc[2] = f.mtime
        out: dict[str, NamespaceUsage] = {}
        for model_name, (files, nbytes, last) in per_model.items():
            ns, model_id = split_model_name(model_name)
            usage = out.setdefault(ns or "(no namespace)", NamespaceUsage(ns or "(no namespace)"))
            usage.model_ids.add(model_id)
            usage.files += int(files)
            usage.bytes += int(nbytes)
            usage.last_access = max(usage.last_access, last)
        return out

    @property
    def cache_bytes(self) -> int:
        """Bytes of every KV file the cache tier owns (live + temp + quarantine)."""
        return sum(f.size for f in self.files if f.cls in ("live", "temp", "quarantine"))


def classify(name: str, in_quarantine: bool) -> tuple[str, str]:
    """(class, LMCache model name for live files) of a file name."""
    if in_quarantine:
        return "quarantine", ""
    if TMP_MARK in name and SUFFIX in name:
        return "temp", ""
    if name.endswith(CACHE_SUFFIXES):
        model_name = _live_model_name(name)
        return ("unparsable", "") if model_name is None else ("live", model_name)
    return "foreign", ""


def _live_model_name(name: str) -> str | None:
    """The LMCache model name if ``name`` has the shape of ``l2_format.format_name`` (or of a
    nixl_store_dynamic ``.bin`` name), else None.  Cheaper than a full parse (no key object),
    which matters once per file in a million-file inventory."""
    stem = name[:-4]  # both suffixes have four characters
    if "@" in stem:
        stem, _, salt = stem.partition("@")
        if not salt or "@" in salt:
            return None
    parts = stem.rsplit("_", 3)
    if len(parts) != 4 or not parts[0] or len(parts[1]) != 8:
        return None
    try:
        int(parts[1], 16)
        int(parts[2], 16)
        bytes.fromhex(parts[3])
    except ValueError:
        return None
    return model_name_from_safe(parts[0])


def build_inventory(root: str | Path, *, progress: Callable[[int], None] | None = None
                    ) -> Inventory:
    """Inventory ``root``; raises InventoryError if it cannot be read at all."""
    base = Path(root)
    if not base.exists():
        raise InventoryError(f"cache root {base} does not exist; check KVP_CACHE_ROOT")
    if base.is_symlink() or not base.is_dir():
        raise InventoryError(f"cache root {base} is not a directory (symlinks are not followed)")
    if not os.access(base, os.R_OK | os.X_OK):
        raise InventoryError(f"cache root {base} is not readable; run as the cache's owner")
    began = time.monotonic()
    errors: list[str] = []
    files: list[CacheFile] = []
    append = files.append
    is_reg, is_lnk = stat.S_ISREG, stat.S_ISLNK
    stack: list[tuple[str, bool]] = [(str(base), False)]
    count = 0
    while stack:
        directory, in_q = stack.pop()
        try:
            it = os.scandir(directory)
        except OSError as exc:
            errors.append(f"cannot read directory {directory}: {exc.strerror}")
            continue
        with it:
            for entry in it:
                name = entry.name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, in_q or (directory == str(base)
                                                           and name == QUARANTINE_DIR)))
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    errors.append(f"cannot stat {entry.path}: {exc.strerror}")
                    continue
                mode = st.st_mode
                if is_lnk(mode) or not is_reg(mode):
                    append(CacheFile(directory, name, "foreign", 0, st.st_mtime))
                    continue
                kind, model_name = classify(name, in_q)
                append(CacheFile(directory, name, kind, st.st_size, st.st_mtime, model_name))
                count += 1
                if progress is not None and count % 10000 == 0:
                    progress(count)
    return Inventory(base, files, errors, time.monotonic() - began)


def stderr_progress(label: str) -> Callable[[int], None] | None:
    """A progress callback printing ``label: N files`` on a terminal, else None."""
    if not sys.stderr.isatty():
        return None

    def report(n: int) -> None:
        sys.stderr.write(f"\r{label}: {n} files")
        sys.stderr.flush()

    return report
