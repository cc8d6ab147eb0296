"""Where a distribution's files are and how they are read: a folder (site-packages, an unpacked
wheel, a source checkout), a package folder, a ``.whl`` read in memory, or the installed
distribution located through its metadata.

Invariants
----------
* Nothing is imported: the installed vLLM and LMCache are found through
  ``importlib.metadata`` only, and a tree's modules are parsed from their bytes on demand, each
  once per :class:`SourceTree`.
* A :class:`SourceTree` holds exactly one top-level package; a path without it raises
  :class:`CompatError`.
* The version is the one in the distribution's ``*.dist-info/METADATA`` (one of the names
  :data:`kvpersist.serving.lmcache_compat.pins.DISTRIBUTIONS` lists), else
  ``<package>/_version.py`` or ``version.py``, else None.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import re
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Literal, TypeAlias

from ...serving.lmcache_compat import pins as lmcache_pins
from .import_uses import _import_uses, _ImportUse
from .parsing import _Module, _parse_module

#: What a distribution may be given as: a folder that holds the top-level package
#: (site-packages, an unpacked wheel, a source checkout), the package folder itself, or a
#: ``.whl`` file.
DistributionPath: TypeAlias = "str | os.PathLike[str]"

#: kvpersist's own package folder (its source is read too: its imports, its connector).
KVPERSIST_ROOT = Path(__file__).resolve().parents[2]


class CompatError(Exception):
    """A distribution cannot be read (no such path, no top-level package in it)."""


@dataclass(frozen=True)
class DistributionInfo:
    """Which distribution was read: its package, where it lies and its version (from its
    ``*.dist-info/METADATA``, or ``<package>/_version.py`` in a checkout; None if neither)."""

    package: str
    location: str
    version: str | None


class SourceTree:
    """The files of one distribution (a folder or a wheel read in memory), parsed on demand."""

    def __init__(self, package: str, location: DistributionPath) -> None:
        self.package = package
        path = Path(location)
        self._zip: zipfile.ZipFile | None = None
        self._names: set[str] = set()
        self._dirs: set[str] = set()
        self._modules: dict[str, _Module | None] = {}
        if path.is_file() and zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            names = [n for n in self._zip.namelist() if not n.endswith("/")]
            marker = f"{package}/__init__.py"
            roots = sorted((n[: -len(marker)] for n in names
                            if n == marker or n.endswith("/" + marker)), key=len)
            if not roots:
                raise CompatError(f"{path}: the wheel holds no top-level package {package!r}")
            self._prefix = roots[0]
            self._names = {n[len(self._prefix):] for n in names if n.startswith(self._prefix)}
            for name in self._names:
                parts = name.split("/")[:-1]
                self._dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
            self._dist_info_names = names
        else:
            if path.name == package and (path / "__init__.py").is_file():
                path = path.parent
            if not (path / package / "__init__.py").is_file():
                raise CompatError(f"{path}: no top-level package {package!r} in this folder")
            self._root = path
        self.info = DistributionInfo(package, str(Path(location)), self._version())

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    # -- raw files
    def read(self, rel: str) -> bytes | None:
        if self._zip is not None:
            if rel not in self._names:
                return None
            return self._zip.read(self._prefix + rel)
        file = self._root / rel
        return file.read_bytes() if file.is_file() else None

    def is_file(self, rel: str) -> bool:
        if self._zip is not None:
            return rel in self._names
        return (self._root / rel).is_file()

    def is_dir(self, rel: str) -> bool:
        if self._zip is not None:
            return rel in self._dirs
        return (self._root / rel).is_dir()

    def files(self, folder: str, suffix: str = ".py", recursive: bool = False) -> list[str]:
        """The files in ``folder`` (or under it), as relative paths, sorted."""
        if self._zip is not None:
            return sorted(n for n in self._names if n.endswith(suffix) and (
                n.startswith(folder + "/") if recursive else n.rpartition("/")[0] == folder))
        base = self._root / folder
        if not base.is_dir():
            return []
        found = base.rglob(f"*{suffix}") if recursive else base.glob(f"*{suffix}")
        return sorted(p.relative_to(self._root).as_posix() for p in found)

    def _version(self) -> str | None:
        metadata: str | None = None
        wanted = {_normalize(d) for d in lmcache_pins.DISTRIBUTIONS.get(self.package,
                                                                        (self.package,))}
        if self._zip is not None:
            for name in self._dist_info_names:
                top, _, rest = name.partition("/")
                if rest == "METADATA" and top.endswith(".dist-info") and _normalize(
                        top.removesuffix(".dist-info").rsplit("-", 1)[0]) in wanted:
                    metadata = self._zip.read(name).decode("utf-8", "replace")
                    break
        else:
            for info in sorted(self._root.glob("*.dist-info")):
                if _normalize(info.name.removesuffix(".dist-info").rsplit("-", 1)[0]) in wanted \
                        and (info / "METADATA").is_file():
                    metadata = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
                    break
        if metadata is not None:
            version = HeaderParser().parsestr(metadata).get("Version")
            return str(version) if version else None
        for candidate in ("_version.py", "version.py"):
            module = self.module(f"{self.package}.{candidate.removesuffix('.py')}")
            if module is None or module.tree is None:
                continue
            for node in module.tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                        isinstance(node.value.value, str) and any(
                            isinstance(t, ast.Name) and t.id in ("__version__", "version")
                            for t in node.targets):
                    return node.value.value
        return None

    # -- modules
    def locate(self, dotted: str) -> tuple[str, Literal["py", "package", "namespace",
                                                          "extension"]] | None:
        """Where module ``dotted`` lies (relative path) and what it is, or None."""
        if dotted != self.package and not dotted.startswith(self.package + "."):
            return None
        rel = dotted.replace(".", "/")
        if self.is_file(f"{rel}.py"):
            return f"{rel}.py", "py"
        if self.is_file(f"{rel}/__init__.py"):
            return f"{rel}/__init__.py", "package"
        if self.is_dir(rel):
            return rel, "namespace"
        folder, _, leaf = rel.rpartition("/")
        if any(f.rpartition("/")[2].startswith(leaf + ".") for f in
               self.files(folder, ".so") + self.files(folder, ".pyd")):
            return rel, "extension"
        return None

    def module(self, dotted: str) -> _Module | None:
        """The module ``dotted`` (a ``.py`` file, a package, a namespace package or a compiled
        extension), parsed, or None when the tree has no such module."""
        if dotted in self._modules:
            return self._modules[dotted]
        found: _Module | None = None
        located = self.locate(dotted)
        if located is not None:
            path, kind = located
            data = self.read(path) if kind in ("py", "package") else None
            if data is not None:
                found = _parse_module(dotted, path, kind == "package", data)
            else:
                found = _Module(dotted, path, kind != "extension", None, [],
                                lazy_getattr=kind == "extension")
        self._modules[dotted] = found
        return found

    def import_uses(self, dotted: str, roots: tuple[str, ...]) -> list[_ImportUse]:
        """The imports of module ``dotted`` under ``roots`` (see :func:`_import_uses`); for a
        folder, remembered per file version so that checks in one process parse it once."""
        located = self.locate(dotted)
        if located is None or located[1] not in ("py", "package"):
            return []
        if self._zip is None and dotted not in self._modules:
            file = self._root / located[0]
            stat = file.stat()
            return list(_file_import_uses(str(file), stat.st_mtime_ns, stat.st_size, dotted,
                                          located[0], located[1] == "package", roots))
        module = self.module(dotted)
        return _import_uses(module, roots) if module is not None else []


@functools.lru_cache(maxsize=8192)
def _file_import_uses(file: str, _mtime_ns: int, _size: int, dotted: str, rel: str,
                      is_package: bool, roots: tuple[str, ...]) -> tuple[_ImportUse, ...]:
    return tuple(_import_uses(_parse_module(dotted, rel, is_package, Path(file).read_bytes()),
                              roots))


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_location(package: str) -> Path:
    """Where the installed distribution of ``package`` lies (its metadata only; nothing is
    imported)."""
    for name in lmcache_pins.DISTRIBUTIONS.get(package, (package,)):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        root = Path(str(dist.locate_file("")))
        if (root / package / "__init__.py").is_file():
            return root
    raise CompatError(f"{package} is not installed here; give its path")
