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
* The two walkers, the C one (``kvpersist.l2._walk``, used when it is built) and the pure-Python
  one, give the same inventory of the same tree (the tests compare them).  An inventory is held
  as columns (numpy arrays, one row per file) so that a million files cost no Python object each;
  :class:`CacheFile` rows are made only for the files a caller asks for.
"""

from __future__ import annotations

import contextlib
import gc
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..config.admin import WALKERS, load_admin_settings
from ..config.values import SettingsError
from .layout import (
    CACHE_SUFFIXES,
    NIXL_SUFFIX,
    QUARANTINE_DIR,
    SUFFIX,
    FormatError,
    KeyFields,
    exact_model_part,
    is_temp_name,
    key_of_stem,
    model_name_from_safe,
    parse_name,
    split_model_name,
    split_stem,
)

try:
    from . import _walk  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the Python walker gives the same result
    _walk = None

CLASSES = ("live", "temp", "quarantine", "unparsable", "foreign")
LIVE, TEMP, QUARANTINE, UNPARSABLE, FOREIGN = range(len(CLASSES))

IntArray = npt.NDArray[np.int64]


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
    def fspath(self) -> str:
        """The path as a string (cheaper than :attr:`path` when done a million times)."""
        return os.path.join(self.dir, self.name)

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
    """Every file under ``root`` as columns; row ``i`` is file ``i``.

    ``cls[i]`` indexes :data:`CLASSES`; ``model_idx[i]`` indexes ``model_names`` (LMCache model
    names) for live files and is -1 otherwise; ``dir_idx[i]`` indexes ``dirs``; the name of
    file ``i`` is ``names[name_end[i-1]:name_end[i]]`` (file-system bytes).
    """

    root: Path
    dirs: list[str]
    model_names: list[str]
    names: bytes
    name_end: IntArray
    cls: npt.NDArray[np.uint8]
    size: IntArray
    mtime_ns: IntArray
    dir_idx: npt.NDArray[np.int32]
    model_idx: npt.NDArray[np.int32]
    errors: list[str]
    seconds: float
    walker: str
    #: ``model_idx`` values whose model part does not name its model exactly (hashed, or an
    #: earlier version's ambiguous name: :func:`kvpersist.l2.layout.exact_model_part`)
    inexact_models: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return int(self.cls.size)

    def name(self, i: int) -> str:
        start = int(self.name_end[i - 1]) if i else 0
        return os.fsdecode(self.names[start:int(self.name_end[i])])

    def file(self, i: int) -> CacheFile:
        i = int(i)
        m = int(self.model_idx[i])
        return CacheFile(self.dirs[self.dir_idx[i]], self.name(i), CLASSES[self.cls[i]],
                         int(self.size[i]), int(self.mtime_ns[i]) / 1e9,
                         self.model_names[m] if m >= 0 else "")

    @property
    def files(self) -> list[CacheFile]:
        """All rows as :class:`CacheFile` (one object per file: for small trees and scrubs)."""
        return [self.file(i) for i in range(len(self))]

    def of_class(self, cls: int) -> IntArray:
        """Row numbers of the files of class ``cls`` (an index into CLASSES), in walk order."""
        return np.flatnonzero(self.cls == cls)

    def by_class(self) -> dict[str, tuple[int, int]]:
        counts = np.bincount(self.cls, minlength=len(CLASSES))
        sizes = np.zeros(len(CLASSES), np.int64)
        np.add.at(sizes, self.cls, self.size)
        return {c: (int(counts[k]), int(sizes[k])) for k, c in enumerate(CLASSES)}

    def namespace_index(self) -> tuple[list[str], npt.NDArray[np.int32]]:
        """(namespaces, per-model index into them): '' for model names without a namespace."""
        names: list[str] = []
        where: dict[str, int] = {}
        of_model = np.empty(len(self.model_names), np.int32)
        for m, model_name in enumerate(self.model_names):
            ns = split_model_name(model_name)[0]
            of_model[m] = where.setdefault(ns, len(names))
            if of_model[m] == len(names):
                names.append(ns)
        return names, of_model

    def namespaces(self) -> dict[str, NamespaceUsage]:
        live = self.model_idx >= 0
        models = self.model_idx[live]
        k = len(self.model_names)
        files = np.bincount(models, minlength=k)
        nbytes = np.zeros(k, np.int64)
        np.add.at(nbytes, models, self.size[live])
        last = np.zeros(k, np.int64)
        np.maximum.at(last, models, self.mtime_ns[live])
        out: dict[str, NamespaceUsage] = {}
        for m, model_name in enumerate(self.model_names):
            ns, model_id = split_model_name(model_name)
            usage = out.setdefault(ns or "(no namespace)", NamespaceUsage(ns or "(no namespace)"))
            usage.model_ids.add(model_id)
            usage.files += int(files[m])
            usage.bytes += int(nbytes[m])
            usage.last_access = max(usage.last_access, int(last[m]) / 1e9)
        return out

    def keys(self, rows: IntArray, *, chunk: int = 32768) -> list[KeyFields]:
        """The object keys of live ``rows`` (of ``.kvp`` and ``.bin`` names alike), in order
        (:func:`keys_of_columns`)."""
        return keys_of_columns(self.names, self.name_end, self.model_idx, self.model_names,
                               rows, chunk=chunk)

    @property
    def cache_bytes(self) -> int:
        """Bytes of every KV file the cache tier owns (live + temp + quarantine)."""
        return int(self.size[self.cls <= QUARANTINE].sum())


def merge_inventories(parts: Sequence[Inventory]) -> Inventory:
    """One inventory of several roots' (the first root names it): rows of each part in turn,
    directories kept as they were (absolute), model names shared."""
    if len(parts) == 1:
        return parts[0]
    models: dict[str, int] = {}
    dirs: list[str] = []
    name_ends: list[IntArray] = []
    model_idx: list[npt.NDArray[np.int32]] = []
    dir_idx: list[npt.NDArray[np.int32]] = []
    inexact: set[int] = set()
    offset = 0
    for part in parts:
        remap = np.array([models.setdefault(m, len(models)) for m in part.model_names] + [-1],
                         np.int32)
        inexact.update(int(remap[m]) for m in part.inexact_models)
        model_idx.append(remap[part.model_idx])  # -1 picks the appended -1
        dir_idx.append(part.dir_idx + np.int32(len(dirs)))
        dirs += part.dirs
        name_ends.append(part.name_end + offset)
        offset += len(part.names)
    return Inventory(
        root=parts[0].root, dirs=dirs, model_names=list(models), names=b"".join(
            p.names for p in parts), name_end=np.concatenate(name_ends),
        cls=np.concatenate([p.cls for p in parts]), size=np.concatenate([p.size for p in parts]),
        mtime_ns=np.concatenate([p.mtime_ns for p in parts]),
        dir_idx=np.concatenate(dir_idx).astype(np.int32),
        model_idx=np.concatenate(model_idx).astype(np.int32),
        errors=[e for p in parts for e in p.errors], seconds=sum(p.seconds for p in parts),
        walker=parts[0].walker, inexact_models=frozenset(inexact))


def root_of(directory: str | Path, roots: Sequence[Path]) -> Path | None:
    """The root among ``roots`` that ``directory`` lies in (the deepest one), or None."""
    path = Path(directory)
    holding = [r for r in roots if path == r or r in path.parents]
    return max(holding, key=lambda r: len(r.parts), default=None)


def keys_of_columns(names: bytes | memoryview, name_end: IntArray, model_idx: npt.NDArray[np.int32],
                    model_names: list[str], rows: IntArray, *, chunk: int = 32768
                    ) -> list[KeyFields]:
    """The object keys of the live-file ``rows`` of inventory-shaped columns (file ``i`` is
    ``names[name_end[i-1]:name_end[i]]`` of model ``model_names[model_idx[i]]``), in order.
    Made in C when built, ``chunk`` rows per call, so that a server thread making a million
    keys lets the others run between calls.  The cyclic garbage collector is paused
    meanwhile: a million new tuples would otherwise trigger collections that cost more than
    making them (1.2 s of 2.0 s measured), and key tuples never form cycles."""
    if _walk is None:
        def stem(r: int) -> str:  # both suffixes have four characters
            start = int(name_end[r - 1]) if r else 0
            return os.fsdecode(bytes(names[start:int(name_end[r])]))[:-4]

        with _gc_paused():
            return [key_of_stem(stem(r)) for r in rows.tolist()]
    rows = np.ascontiguousarray(rows, np.int64)
    ends, models = np.ascontiguousarray(name_end, np.int64).tobytes(), \
        np.ascontiguousarray(model_idx, np.int32).tobytes()
    out: list[KeyFields] = []
    with _gc_paused():
        for start in range(0, rows.size, chunk):
            out += _walk.live_keys(names, ends, models, rows[start:start + chunk].tobytes(),
                                   model_names, KeyFields)
    return out


def index_of_columns(names: bytes | memoryview, name_end: IntArray,
                     model_idx: npt.NDArray[np.int32], model_names: list[str], rows: IntArray,
                     sizes: IntArray, *, chunk: int = 32768) -> dict[KeyFields, int]:
    """``{key: size}`` of the live-file ``rows`` (``sizes`` one per row), in row order (a key
    given twice keeps its last size): what :func:`keys_of_columns` makes, built straight into
    the dict in C when the walker is built, with no list of keys in between."""
    if _walk is None:
        return dict(zip(keys_of_columns(names, name_end, model_idx, model_names, rows),
                        np.asarray(sizes, np.int64).tolist(), strict=True))
    rows = np.ascontiguousarray(rows, np.int64)
    sizes = np.ascontiguousarray(sizes, np.int64)
    if sizes.size != rows.size:
        raise ValueError(f"{sizes.size} sizes for {rows.size} rows")
    ends, models = np.ascontiguousarray(name_end, np.int64).tobytes(), \
        np.ascontiguousarray(model_idx, np.int32).tobytes()
    out: dict[KeyFields, int] = {}
    with _gc_paused():
        for start in range(0, rows.size, chunk):
            _walk.live_index(out, names, ends, models, rows[start:start + chunk].tobytes(),
                             sizes[start:start + chunk].tobytes(), model_names, KeyFields)
    return out


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (if it runs) for the block."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def classify(name: str, in_quarantine: bool) -> tuple[str, str]:
    """(class, LMCache model name for live files) of a file name."""
    kind, safe_model = _classify(name, in_quarantine)
    return CLASSES[kind], model_name_from_safe(safe_model) if safe_model else ""


def _classify(name: str, in_quarantine: bool) -> tuple[int, str]:
    """(index into CLASSES, safe model name for live files); the C walker's ``classify_name``."""
    if in_quarantine:
        return QUARANTINE, ""
    if is_temp_name(name):
        return TEMP, ""
    if name.endswith(CACHE_SUFFIXES):
        fields = split_stem(name[:-4])  # both suffixes have four characters
        return (UNPARSABLE, "") if fields is None else (LIVE, fields[0])
    return FOREIGN, ""


def build_inventory(root: str | Path, *, progress: Callable[[int], None] | None = None,
                    walker: str | None = None, threads: int | None = None) -> Inventory:
    """Inventory ``root``; raises InventoryError if it cannot be read at all.

    ``walker``: ``auto`` (C when built, else Python), ``c`` or ``python``; None: ``KVP_WALKER``
    (the operator's tools).  ``threads``: how many threads the C walker stats files on (0: one
    per CPU up to 8; None: ``KVP_WALK_THREADS``); the inventory never depends on it.  The
    server's store passes both from its validated settings.
    """
    base = Path(root)
    if not base.exists():
        raise InventoryError(f"cache root {base} does not exist; check KVP_CACHE_ROOT")
    if base.is_symlink() or not base.is_dir():
        raise InventoryError(f"cache root {base} is not a directory (symlinks are not followed)")
    if not os.access(base, os.R_OK | os.X_OK):
        raise InventoryError(f"cache root {base} is not readable; run as the cache's owner")
    if walker is None or threads is None:
        try:
            configured = load_admin_settings()
        except SettingsError as exc:
            raise InventoryError(str(exc)) from None
        walker = configured.walker if walker is None else walker
        threads = configured.walk_threads if threads is None else threads
    if walker not in WALKERS:
        raise InventoryError(f"unknown walker {walker!r}; one of {', '.join(WALKERS)}")
    if walker == "c" and _walk is None:
        raise InventoryError("the C walker kvpersist.l2._walk is not built; run scripts/bootstrap.sh")
    use_c = walker == "c" or (walker == "auto" and _walk is not None)
    began = time.monotonic()
    cols = _walk.scan(str(base), progress, threads) if use_c else _python_scan(str(base), progress)
    dirs, safe_models, names, name_end, cls, size, mtime_ns, dir_idx, model_idx, errors = cols
    return Inventory(
        base, dirs, [model_name_from_safe(m) for m in safe_models], names,
        np.frombuffer(name_end, np.int64), np.frombuffer(cls, np.uint8),
        np.frombuffer(size, np.int64), np.frombuffer(mtime_ns, np.int64),
        np.frombuffer(dir_idx, np.int32), np.frombuffer(model_idx, np.int32),
        errors, time.monotonic() - began, "c" if use_c else "python",
        frozenset(m for m, safe in enumerate(safe_models) if not exact_model_part(safe)))


def _python_scan(root: str, progress: Callable[[int], None] | None) -> tuple[Any, ...]:
    """The pure-Python walker: the same columns as ``_walk.scan``, in the same order."""
    dirs: list[str] = []
    models: dict[str, int] = {}
    names = bytearray()
    name_end: list[int] = []
    cls: list[int] = []
    sizes: list[int] = []
    mtimes: list[int] = []
    dir_idx: list[int] = []
    model_idx: list[int] = []
    errors: list[str] = []
    is_reg, is_lnk = stat.S_ISREG, stat.S_ISLNK
    stack: list[tuple[str, bool]] = []
    count = 0

    def add(name: str, kind: int, size: int, mtime_ns: int, d: int, model: int) -> None:
        names.extend(os.fsencode(name))
        name_end.append(len(names))
        cls.append(kind)
        sizes.append(size)
        mtimes.append(mtime_ns)
        dir_idx.append(d)
        model_idx.append(model)

    directory, in_q, is_root = root, False, True
    while True:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            errors.append(f"cannot read directory {directory}: {exc.strerror}")
            fd = -1
        if fd >= 0:
            dirs.append(directory)
            d = len(dirs) - 1
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        name = entry.name
                        path = os.path.join(directory, name)
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                stack.append((path, in_q or (is_root and name == QUARANTINE_DIR)))
                                continue
                            st = entry.stat(follow_symlinks=False)
                        except OSError as exc:
                            errors.append(f"cannot stat {path}: {exc.strerror}")
                            continue
                        mode = st.st_mode
                        if is_lnk(mode) or not is_reg(mode):
                            add(name, FOREIGN, 0, st.st_mtime_ns, d, -1)
                            continue
                        kind, safe_model = _classify(name, in_q)
                        model = models.setdefault(safe_model, len(models)) if kind == LIVE else -1
                        add(name, kind, st.st_size, st.st_mtime_ns, d, model)
                        count += 1
                        if progress is not None and count % 10000 == 0:
                            progress(count)
            finally:
                os.close(fd)
        if not stack:
            break
        directory, in_q = stack.pop()
        is_root = False
    return (dirs, list(models), bytes(names), np.array(name_end, np.int64).tobytes(),
            bytes(cls), np.array(sizes, np.int64).tobytes(), np.array(mtimes, np.int64).tobytes(),
            np.array(dir_idx, np.int32).tobytes(), np.array(model_idx, np.int32).tobytes(), errors)
