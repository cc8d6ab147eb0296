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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .l2_format import SUFFIX, TMP_MARK, FormatError, KeyFields, parse_name
from .l2_store import QUARANTINE_DIR

NIXL_SUFFIX = ".bin"
CACHE_SUFFIXES = (SUFFIX, NIXL_SUFFIX)
CLASSES = ("live", "temp", "quarantine", "unparsable", "foreign")


class InventoryError(RuntimeError):
    """The root cannot be inventoried (missing, not a directory, unreadable)."""


@dataclass(frozen=True)
class CacheFile:
    """One file under the root.  ``key`` is set for live files only."""

    path: Path
    cls: str
    size: int  # bytes allocated on disk (st_blocks * 512) never exceed this; we count st_size
    mtime: float
    key: KeyFields | None = None

    @property
    def namespace(self) -> str:
        return self.key.namespace if self.key else ""

    @property
    def model_id(self) -> str:
        if self.key is None:
            return ""
        name = self.key.model_name
        return name.rsplit("/", 1)[0] if self.key.namespace else name


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
        out = {c: (0, 0) for c in CLASSES}
        for f in self.files:
            n, b = out[f.cls]
            out[f.cls] = (n + 1, b + f.size)
        return out

    def namespaces(self) -> dict[str, NamespaceUsage]:
        out: dict[str, NamespaceUsage] = {}
        for f in self.files:
            if f.cls != "live":
                continue
            ns = f.namespace or "(no namespace)"
            usage = out.setdefault(ns, NamespaceUsage(ns))
            usage.model_ids.add(f.model_id)
            usage.files += 1
            usage.bytes += f.size
            usage.last_access = max(usage.last_access, f.mtime)
        return out

    @property
    def live_bytes(self) -> int:
        return sum(f.size for f in self.files if f.cls == "live")

    @property
    def cache_bytes(self) -> int:
        """Bytes of every KV file the cache tier owns (live + temp + quarantine)."""
        return sum(f.size for f in self.files if f.cls in ("live", "temp", "quarantine"))


def classify(name: str, in_quarantine: bool) -> tuple[str, KeyFields | None]:
    if in_quarantine:
        return "quarantine", None
    if TMP_MARK in name and SUFFIX in name:
        return "temp", None
    if name.endswith(CACHE_SUFFIXES):
        try:
            return "live", parse_name(name[: -len(NIXL_SUFFIX)] + SUFFIX
                                      if name.endswith(NIXL_SUFFIX) else name)
        except FormatError:
            return "unparsable", None
    return "foreign", None


def _walk(root: Path, errors: list[str]) -> Iterator[tuple[os.DirEntry[str], bool]]:
    """Yield (entry, in_quarantine) for every non-directory entry, never following symlinks."""
    stack: list[tuple[str, bool]] = [(str(root), False)]
    while stack:
        directory, in_q = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            errors.append(f"cannot read directory {directory}: {exc.strerror}")
            continue
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                stack.append((entry.path, in_q or (directory == str(root)
                                                   and entry.name == QUARANTINE_DIR)))
            else:
                yield entry, in_q


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
    for count, (entry, in_q) in enumerate(_walk(base, errors), 1):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            errors.append(f"cannot stat {entry.path}: {exc.strerror}")
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            files.append(CacheFile(Path(entry.path), "foreign", 0, st.st_mtime))
            continue
        cls, key = classify(entry.name, in_q)
        files.append(CacheFile(Path(entry.path), cls, st.st_size, st.st_mtime, key))
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
