"""Would kvpersist keep its features on with this vLLM and this LMCache?  Answered from their
source files alone: no GPU, and neither package is imported, so a wheel of another build (CUDA,
ROCm) or a source checkout is checked on any host.

kvpersist depends on the two packages in three ways, and :func:`check` reads all three:

1. **The fence's pins** (:data:`kvpersist.serving.lmcache_compat.pins.FEATURES`): each pinned
   function's source is cut out of its file as ``inspect.getsource`` would give it for the
   undecorated function (decorator lines included, a method's indentation kept) and digested
   as :func:`~kvpersist.serving.lmcache_compat.pins.source_digest` does.  A feature with a
   changed or missing function is off; an ``unsafe_without`` one closes the gate.
2. **vLLM's engine configuration** (:func:`~kvpersist.serving.lmcache_compat.engine_config.
   engine_field_names`): ``VllmConfig``'s dataclass fields, one level into each sub-config
   dataclass, plus :data:`~kvpersist.serving.lmcache_compat.engine_config.NESTED`.  A field
   :data:`~kvpersist.identity.engine_fields.ENGINE_FIELDS` does not classify closes the gate;
   an entry the target no longer has is reported as stale.
3. **The connector's API surface**: every ``vllm``/``lmcache`` import of kvpersist's own code
   (``testing/`` excepted) and every ``vllm`` import of LMCache's vLLM integration modules must
   resolve in the target trees; vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` are compared
   with :data:`TESTED_CONNECTOR_SURFACE`, recorded from vLLM 0.32.0, and with how
   ``kv_connector.py`` forwards (instance methods and properties forwarded to ``inner``
   automatically, class and static methods only where ``KvPersistConnector`` defines them).

Invariants
----------
* Nothing here imports vLLM or LMCache, at import time or in :func:`check`; the installed
  distributions are located through their metadata only.
* On the tested versions every pin digest, the field list and the connector surface equal what
  the run-time code computes (the tests prove it), so a difference reported for another
  version is a difference of that version.
* :attr:`CompatReport.exit_code` is 2 when caching would not run (the gate closes, or the
  connector would not import or instantiate), 1 when it runs with less (a feature off, an
  LMCache override bypassed), and 0 otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import io
import os
import re
import tokenize
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any, Literal, TypeAlias

from ..identity.engine_fields import ENGINE_FIELDS
from ..serving.lmcache_compat import engine_config
from ..serving.lmcache_compat import pins as lmcache_pins

#: What a distribution may be given as: a folder that holds the top-level package
#: (site-packages, an unpacked wheel, a source checkout), the package folder itself, or a
#: ``.whl`` file.
DistributionPath: TypeAlias = "str | os.PathLike[str]"
Severity = Literal["breaks", "degrades", "info"]

KVPERSIST_ROOT = Path(__file__).resolve().parents[1]
_KV_CONNECTOR = KVPERSIST_ROOT / "serving" / "connector" / "kv_connector.py"
_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
_LMCACHE_CONNECTOR = ("lmcache.integration.vllm.lmcache_mp_connector", "LMCacheMPConnector")
_LMCACHE_VLLM_INTEGRATION = "lmcache/integration/vllm"

#: The connector API of the tested vLLM (0.32.0): per base class, each public method (and
#: ``__init__``) as (kind, abstract, parameter names).  Kinds: method, classmethod,
#: staticmethod, property.  Parameters: ``*name``/``**name`` for variadic ones and ``*`` before
#: keyword-only ones.  Recorded once with :func:`connector_surface`; a test proves the installed
#: 0.32.0 still gives exactly this.
TESTED_CONNECTOR_SURFACE: dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]] = {
    "KVConnectorBase_V1": {
        "__init__": ("method", False, ("self", "vllm_config", "role", "kv_cache_config")),
        "bind_connector_metadata": ("method", False, ("self", "connector_metadata")),
        "bind_gpu_block_pool": ("method", False, ("self", "gpu_block_pool")),
        "bind_kv_cache_manager": ("method", False, ("self", "kv_cache_manager")),
        "build_connector_meta": ("method", True, ("self", "scheduler_output")),
        "build_connector_worker_meta": ("method", False, ("self",)),
        "build_kv_connector_stats": ("classmethod", False, ("cls", "data")),
        "build_prom_metrics": ("classmethod", False, ("cls", "vllm_config", "metric_types",
                                                      "labelnames", "per_engine_labelvalues")),
        "clear_connector_metadata": ("method", False, ("self",)),
        "finish_forward": ("method", False, ("self",)),
        "get_block_ids_with_load_errors": ("method", False, ("self",)),
        "get_external_cache_hit_sources": ("method", False, ("self", "request",
                                                             "num_external_tokens")),
        "get_finished": ("method", False, ("self", "finished_req_ids")),
        "get_finished_count": ("method", False, ("self",)),
        "get_handshake_metadata": ("method", False, ("self",)),
        "get_kv_connector_kv_cache_events": ("method", False, ("self",)),
        "get_kv_connector_stats": ("method", False, ("self",)),
        "get_loaded_kv_cache_group_ids": ("method", False, ("self", "request")),
        "get_mem_pool_context": ("method", False, ("self",)),
        "get_num_new_matched_tokens": ("method", True, ("self", "request", "num_computed_tokens")),
        "get_required_kvcache_layout": ("classmethod", False, ("cls", "vllm_config")),
        "get_transfer_results": ("method", False, ("self", "finished_req_ids")),
        "handle_preemptions": ("method", False, ("self", "kv_connector_metadata")),
        "has_connector_metadata": ("method", False, ("self",)),
        "has_pending_block_frees": ("method", False, ("self",)),
        "has_pending_push_work": ("method", False, ("self",)),
        "on_new_request": ("method", False, ("self", "request")),
        "register_finished_partial_tail": ("method", False, ("self", "request", "block_ids",
                                                             "partial_tail_offloads")),
        "register_kv_caches": ("method", False, ("self", "kv_caches")),
        "request_finished": ("method", False, ("self", "request", "block_ids")),
        "requires_kv_delivery": ("property", False, ("self",)),
        "requires_piecewise_for_cudagraph": ("classmethod", False, ("cls", "extra_config")),
        "reset_cache": ("method", False, ("self",)),
        "reset_capture_state": ("method", False, ("self",)),
        "role": ("property", False, ("self",)),
        "save_kv_layer": ("method", True, ("self", "layer_name", "kv_layer", "attn_metadata",
                                           "**kwargs")),
        "set_host_xfer_buffer_ops": ("method", False, ("self", "copy_operation")),
        "set_xfer_handshake_metadata": ("method", False, ("self", "metadata")),
        "set_xfer_handshake_metadata_pp_aware": ("method", False, ("self", "metadata")),
        "shutdown": ("method", False, ("self",)),
        "start_load_kv": ("method", True, ("self", "forward_context", "**kwargs")),
        "supports_divergent_local_hybrid_hits": ("property", False, ("self",)),
        "take_events": ("method", False, ("self",)),
        "update_connector_output": ("method", False, ("self", "connector_output")),
        "update_state_after_alloc": ("method", True, ("self", "request", "blocks",
                                                      "num_external_tokens")),
        "wait_for_layer_load": ("method", True, ("self", "layer_name")),
        "wait_for_save": ("method", True, ("self",)),
    },
    "SupportsHMA": {
        "request_finished_all_groups": ("method", True, ("self", "request", "block_ids")),
    },
}


class CompatError(Exception):
    """A distribution cannot be read (no such path, no top-level package in it)."""


# ---------------------------------------------------------------------------------------------
# Reading a distribution's files


@dataclass(frozen=True)
class DistributionInfo:
    """Which distribution was read: its package, where it lies and its version (from its
    ``*.dist-info/METADATA``, or ``<package>/_version.py`` in a checkout; None if neither)."""

    package: str
    location: str
    version: str | None


@dataclass
class _Module:
    """One parsed module: its bindings at run time (``if TYPE_CHECKING:`` bodies skipped)."""

    name: str
    path: str  # relative to the distribution's root
    is_package: bool
    tree: ast.Module | None  # None: a namespace package or a compiled extension
    lines: list[str]
    bindings: dict[str, _Binding] = field(default_factory=dict)
    star_imports: list[str] = field(default_factory=list)
    lazy_getattr: bool = False


@dataclass(frozen=True)
class _Binding:
    kind: Literal["def", "class", "assign", "from", "import"]
    node: ast.AST
    #: for "from": the module imported from and the name in it; for "import": the module bound
    source: str = ""
    name: str = ""


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


def _source_lines(data: bytes) -> list[str]:
    """The file's lines as ``linecache`` (and so ``inspect``) holds them."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    lines = io.TextIOWrapper(io.BytesIO(data), encoding, line_buffering=True).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def _parse_module(name: str, path: str, is_package: bool, data: bytes) -> _Module:
    lines = _source_lines(data)
    try:
        tree = ast.parse("".join(lines), filename=path)
    except SyntaxError:
        return _Module(name, path, is_package, None, lines, lazy_getattr=True)
    module = _Module(name, path, is_package, tree, lines)
    _collect_bindings(module, tree.body)
    return module


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_body(stmt: ast.If) -> list[ast.stmt]:
    """The branches of an ``if`` that may run: ``if TYPE_CHECKING:`` runs only its ``else``."""
    if _is_type_checking(stmt.test):
        return stmt.orelse
    if isinstance(stmt.test, ast.UnaryOp) and isinstance(stmt.test.op, ast.Not) and \
            _is_type_checking(stmt.test.operand):
        return stmt.body
    return [*stmt.body, *stmt.orelse]


def _absolute(module: _Module, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - level + 1]
    return ".".join([*parts, *([target] if target else [])])


def _collect_bindings(module: _Module, body: Iterable[ast.stmt]) -> None:
    """Each name the module's top level binds at run time, the last binding winning."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            module.bindings[stmt.name] = _Binding("def", stmt)
            if stmt.name == "__getattr__":
                module.lazy_getattr = True
        elif isinstance(stmt, ast.ClassDef):
            module.bindings[stmt.name] = _Binding("class", stmt)
        elif isinstance(stmt, ast.Assign | ast.AugAssign | ast.AnnAssign):
            if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
                continue  # a bare annotation binds nothing
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name):
                        module.bindings[node.id] = _Binding("assign", stmt)
        elif isinstance(stmt, ast.ImportFrom):
            source = _absolute(module, stmt.level, stmt.module)
            for alias in stmt.names:
                if alias.name == "*":
                    module.star_imports.append(source)
                else:
                    module.bindings[alias.asname or alias.name] = _Binding(
                        "from", stmt, source, alias.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                module.bindings[bound] = _Binding(
                    "import", stmt, alias.name if alias.asname else bound)
        elif isinstance(stmt, ast.If):
            _collect_bindings(module, _runtime_body(stmt))
        elif isinstance(stmt, ast.Try):
            _collect_bindings(module, [*stmt.body, *[s for h in stmt.handlers for s in h.body],
                                       *stmt.orelse, *stmt.finalbody])
        elif isinstance(stmt, ast.With | ast.For | ast.While):
            _collect_bindings(module, [*stmt.body, *getattr(stmt, "orelse", [])])


# ---------------------------------------------------------------------------------------------
# Resolving names across modules


@dataclass(frozen=True)
class _Def:
    """What a name resolved to: a def/class/assignment in ``module``, or a module itself."""

    module: _Module
    node: ast.AST | None  # None: the name is the module


class SourceTrees:
    """Distributions read together, each holding its top-level package; names resolve across
    them."""

    def __init__(self, *trees: SourceTree) -> None:
        self.by_package = {t.package: t for t in trees}

    def close(self) -> None:
        for tree in self.by_package.values():
            tree.close()

    def module(self, dotted: str) -> _Module | None:
        tree = self.by_package.get(dotted.split(".")[0])
        return tree.module(dotted) if tree is not None else None

    def resolve(self, module_name: str, name: str, depth: int = 0) -> _Def | None:
        """What ``name`` is in ``module_name`` at run time, following imports; None when it is
        not defined there (or lies outside both trees)."""
        module = self.module(module_name)
        if module is None or depth > 24:
            return None
        binding = module.bindings.get(name)
        if binding is None:
            submodule = self.module(f"{module_name}.{name}")
            if submodule is not None and module.is_package:
                return _Def(submodule, None)
            for star in module.star_imports:
                found = self.resolve(star, name, depth + 1)
                if found is not None:
                    return found
            return None
        if binding.kind == "from":
            submodule = self.module(f"{binding.source}.{binding.name}")
            if submodule is not None:
                return _Def(submodule, None)
            return self.resolve(binding.source, binding.name, depth + 1)
        if binding.kind == "import":
            target = self.module(binding.source)
            return _Def(target, None) if target is not None else None
        if binding.kind == "assign" and isinstance(binding.node, ast.Assign) and isinstance(
                binding.node.value, ast.Name | ast.Attribute):
            aliased = self.resolve_expr(module, binding.node.value, depth + 1)
            if aliased is not None:
                return aliased
        return _Def(module, binding.node)

    def binds(self, module_name: str, name: str, depth: int = 0) -> bool:
        """Whether ``from module_name import name`` finds ``name``: the module binds it at its
        top level (def, class, assignment, import, a star import's name) or it is a
        submodule of the package."""
        module = self.module(module_name)
        if module is None or depth > 24:
            return False
        if name in module.bindings or module.lazy_getattr or (
                module.is_package and self.module(f"{module_name}.{name}") is not None):
            return True
        return any(self.binds(star, name, depth + 1) for star in module.star_imports)

    def resolve_expr(self, module: _Module, expr: ast.expr, depth: int = 0) -> _Def | None:
        """What a ``Name`` or dotted ``Attribute`` expression means in ``module``."""
        if isinstance(expr, ast.Name):
            return self.resolve(module.name, expr.id, depth)
        if isinstance(expr, ast.Attribute):
            head = self.resolve_expr(module, expr.value, depth)
            if head is not None and head.node is None:
                return self.resolve(head.module.name, expr.attr, depth)
        return None

    def find(self, module_name: str, qualname: str) -> _Def | None:
        """The definition ``qualname`` names in ``module_name`` (methods found through the
        class's bases, as ``getattr`` finds them)."""
        found = self.resolve(module_name, qualname.split(".")[0])
        for part in qualname.split(".")[1:]:
            if found is None:
                return None
            if found.node is None:
                found = self.resolve(found.module.name, part)
            elif isinstance(found.node, ast.ClassDef):
                found = self.member(found, part)
            else:
                return None
        return found

    def member(self, cls: _Def, name: str, depth: int = 0) -> _Def | None:
        """``name`` in class ``cls`` or its bases (depth first, as a simple MRO)."""
        assert isinstance(cls.node, ast.ClassDef)
        own = _class_members(cls.node).get(name)
        if own is not None:
            return _Def(cls.module, own)
        if depth > 16:
            return None
        for base in cls.node.bases:
            resolved = self.resolve_expr(cls.module, base)
            if resolved is not None and isinstance(resolved.node, ast.ClassDef):
                found = self.member(resolved, name, depth + 1)
                if found is not None:
                    return found
        return None


def _class_members(cls: ast.ClassDef) -> dict[str, ast.stmt]:
    """A class body's bindings (the last definition of a name wins; a property keeps its getter
    so that its kind is known)."""
    out: dict[str, ast.stmt] = {}

    def visit(body: Iterable[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                previous = out.get(stmt.name)
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and isinstance(
                        previous, ast.FunctionDef | ast.AsyncFunctionDef) and \
                        _method_kind(previous) == "property" and _method_kind(stmt) != "method":
                    continue  # a property's setter or deleter
                out[stmt.name] = stmt
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = stmt
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt
            elif isinstance(stmt, ast.If):
                visit(_runtime_body(stmt))
            elif isinstance(stmt, ast.Try):
                visit([*stmt.body, *stmt.orelse])

    visit(cls.body)
    return out


def _dotted(expr: ast.expr) -> str:
    if isinstance(expr, ast.Call):
        return _dotted(expr.func)
    if isinstance(expr, ast.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr}"
    if isinstance(expr, ast.Name):
        return expr.id
    return ""


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    return [_dotted(d) for d in node.decorator_list]


def _method_kind(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    for name in _decorators(node):
        tail = name.rpartition(".")[2]
        if tail in ("classmethod", "staticmethod"):
            return tail
        if tail in ("property", "cached_property") or tail in ("setter", "getter", "deleter"):
            return "property"
    return "method"


def _params(args: ast.arguments) -> tuple[str, ...]:
    out = [a.arg for a in [*args.posonlyargs, *args.args]]
    if args.vararg is not None:
        out.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        out.append("*")
    out.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg is not None:
        out.append(f"**{args.kwarg.arg}")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# 1. The fence's pins


def function_source(module: _Module, node: ast.AST) -> str:
    """The source ``inspect.getsource`` gives for this (undecorated) function: from its first
    decorator line (the code object's first line) to the end of its block, indentation kept."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise TypeError("not a function")
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return "".join(inspect.getblock(module.lines[first - 1:]))


def pin_digest(trees: SourceTrees, module: str, qualname: str) -> str:
    """Like :func:`pins.source_digest`, from the files: the digest, or ``missing``."""
    found = trees.find(module, qualname)
    if found is None or not isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef) or \
            _method_kind(found.node) == "property":
        return "missing"  # inspect.getsource fails on a property or a non-function too
    try:
        source = function_source(found.module, found.node)
    except TypeError:
        return "missing"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ChangedSource:
    """A pinned function whose source in the target differs from the pin (``found`` is its
    digest there, or ``missing`` when the function is gone)."""

    module: str
    qualname: str
    pinned: str
    found: str


@dataclass(frozen=True)
class FeatureResult:
    """One fence feature: on exactly when none of its pinned functions changed."""

    name: str
    on: bool
    unsafe_without: bool
    changed: tuple[ChangedSource, ...]
    if_off: str


def _check_features(trees: SourceTrees) -> tuple[FeatureResult, ...]:
    out = []
    for feature in lmcache_pins.FEATURES.values():
        changed = []
        for module, qualname, digest in feature.sources:
            found = pin_digest(trees, module, qualname)
            if found != digest:
                changed.append(ChangedSource(module, qualname, digest, found))
        out.append(FeatureResult(feature.name, not changed, feature.unsafe_without,
                                 tuple(changed), feature.if_off))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# 2. vLLM's engine configuration fields


def _is_dataclass_def(trees: SourceTrees, cls: _Def, depth: int = 0) -> bool:
    """Decorated ``@dataclass`` (stdlib or pydantic) or vLLM's ``@config``, or a subclass of a
    dataclass (``dataclasses.is_dataclass`` is true for those too)."""
    assert isinstance(cls.node, ast.ClassDef)
    if any(d.rpartition(".")[2] in ("dataclass", "config") for d in _decorators(cls.node)):
        return True
    return depth < 16 and any(_is_dataclass_def(trees, b, depth + 1) for b in _bases(trees, cls))


def _bases(trees: SourceTrees, cls: _Def) -> list[_Def]:
    assert isinstance(cls.node, ast.ClassDef)
    out = []
    for base in cls.node.bases:
        resolved = trees.resolve_expr(cls.module, base)
        if resolved is not None and isinstance(resolved.node, ast.ClassDef):
            out.append(resolved)
    return out


def _annotation_names(annotation: ast.expr) -> tuple[str, ...]:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return ()
    if isinstance(annotation, ast.Subscript):
        return (_dotted(annotation.value),)
    return (_dotted(annotation),)


def _is_pseudo_field(annotation: ast.expr) -> bool:
    """``ClassVar``, ``InitVar`` and ``KW_ONLY`` annotations make no dataclass field."""
    return any(n.rpartition(".")[2] in ("ClassVar", "InitVar", "KW_ONLY")
               or n.startswith(("ClassVar[", "InitVar[")) for n in _annotation_names(annotation))


def dataclass_fields(trees: SourceTrees, cls: _Def, depth: int = 0) -> dict[str, ast.AnnAssign]:
    """The fields ``dataclasses.fields`` lists for ``cls``, in its order: those of dataclass
    bases first, then the class's own annotated names (a redefinition keeps its place)."""
    assert isinstance(cls.node, ast.ClassDef)
    out: dict[str, ast.AnnAssign] = {}
    if depth < 16:
        for base in reversed(_bases(trees, cls)):
            if _is_dataclass_def(trees, base):
                out.update(dataclass_fields(trees, base, depth + 1))
    if any(d.rpartition(".")[2] in ("dataclass", "config") for d in _decorators(cls.node)):
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                    not _is_pseudo_field(stmt.annotation):
                out[stmt.target.id] = stmt
    return out


def _union_members(expr: ast.expr) -> list[ast.expr]:
    """The arguments ``typing.get_args`` gives (``X | None``, ``Optional[X]``, ``Union[...]``
    flattened, ``Annotated[X, ...]`` reduced to X as ``get_type_hints`` does), or [expr]."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        try:
            expr = ast.parse(expr.value, mode="eval").body
        except SyntaxError:
            return []
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        return [*_union_members(expr.left), *_union_members(expr.right)]
    if isinstance(expr, ast.Subscript):
        head = _dotted(expr.value).rpartition(".")[2]
        items = list(expr.slice.elts) if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        if head == "Annotated":
            return _union_members(items[0])
        if head in ("Optional", "Union"):
            return [m for item in items for m in _union_members(item)]
        return items  # another generic: get_args gives its arguments
    return [expr]


def _config_class(trees: SourceTrees, module: _Module, annotation: ast.expr) -> _Def | None:
    """The dataclass a field holds (``X``, ``X | None``, ``Optional[X]``), as
    :func:`engine_config._config_class` finds it at run time, or None."""
    for member in _union_members(annotation):
        resolved = trees.resolve_expr(module, member) if isinstance(
            member, ast.Name | ast.Attribute) else None
        if resolved is not None and isinstance(resolved.node, ast.ClassDef) and \
                _is_dataclass_def(trees, resolved):
            return resolved
    return None


@dataclass(frozen=True)
class EngineFields:
    """The target's engine configuration against :data:`ENGINE_FIELDS`.  ``unknown`` closes
    the gate; ``stale`` entries are harmless (nothing sets a field that does not exist) but
    should be removed; ``unresolved`` names config classes this check could not read."""

    count: int
    unknown: tuple[str, ...]
    stale: tuple[str, ...]
    unresolved: tuple[str, ...] = ()


def engine_field_names_from_source(trees: SourceTrees) -> tuple[list[str], list[str]]:
    """Every field name of the target's ``VllmConfig`` as :func:`engine_config.
    engine_field_names` spells them, and what could not be resolved."""
    unresolved: list[str] = []
    vllm_config = trees.find("vllm.config", "VllmConfig")
    if vllm_config is None or not isinstance(vllm_config.node, ast.ClassDef):
        return [], ["vllm.config.VllmConfig"]
    names: list[str] = []
    for top, stmt in dataclass_fields(trees, vllm_config).items():
        owner = trees.module(_owner_module(trees, vllm_config, top))
        cls = _config_class(trees, owner or vllm_config.module, stmt.annotation)
        if cls is None:
            names.append(top)
            continue
        names.extend(f"{top}.{sub}" for sub in dataclass_fields(trees, cls))
    for prefix, dotted in engine_config.NESTED.items():
        module, _, name = dotted.rpartition(".")
        nested = trees.find(module, name)
        if nested is None or not isinstance(nested.node, ast.ClassDef):
            unresolved.append(dotted)
            continue
        names.extend(f"{prefix}.{sub}" for sub in dataclass_fields(trees, nested))
    return names, unresolved


def _owner_module(trees: SourceTrees, cls: _Def, field_name: str, depth: int = 0) -> str:
    """The module whose globals resolve ``field_name``'s annotation (the defining class's)."""
    assert isinstance(cls.node, ast.ClassDef)
    if any(isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and
           s.target.id == field_name for s in cls.node.body) or depth > 16:
        return cls.module.name
    for base in _bases(trees, cls):
        if field_name in dataclass_fields(trees, base):
            return _owner_module(trees, base, field_name, depth + 1)
    return cls.module.name


def _check_engine_fields(trees: SourceTrees) -> EngineFields:
    names, unresolved = engine_field_names_from_source(trees)
    present = set(names)
    return EngineFields(len(names), tuple(n for n in names if n not in ENGINE_FIELDS),
                        tuple(n for n in ENGINE_FIELDS if n not in present), tuple(unresolved))


# ---------------------------------------------------------------------------------------------
# 3. The connector's API surface


@dataclass(frozen=True)
class ApiFinding:
    """One difference of the connector's API.  ``severity``: ``breaks`` (the connector would
    not import or instantiate, or an override kvpersist or LMCache relies on would be called
    wrongly or never), ``degrades`` (it runs, with less), ``info`` (no effect on serving)."""

    kind: str
    name: str
    severity: Severity
    detail: str


#: When an import runs: at the module's import, inside a function (when it is called), or
#: never (``if TYPE_CHECKING:``).
Context = Literal["module", "lazy", "type-only"]


@dataclass(frozen=True)
class _ImportUse:
    module: str  # the absolute module imported (from)
    names: tuple[str, ...]  # the names imported from it; () for ``import module``
    where: str
    context: Context
    #: inside a ``try`` that catches ImportError: (its number in the file, "try" for its body or
    #: "except" for a handler, which runs only when the body failed)
    guard: tuple[int, str] | None = None


def _import_uses(module: _Module, roots: tuple[str, ...]) -> list[_ImportUse]:
    """Every import of a module under ``roots`` that ``module`` makes, and when it runs."""
    if module.tree is None:
        return []
    out: list[_ImportUse] = []
    tries = iter(range(1, 1 << 30))

    def visit(node: ast.AST, context: Context, guard: tuple[int, str] | None) -> None:
        # imports are statements: only statement bodies are walked, never expressions
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, None) or ():
                if isinstance(child, ast.stmt | ast.ExceptHandler | ast.match_case):
                    handle(child, context, guard)

    def handle(node: ast.AST, context: Context, guard: tuple[int, str] | None) -> None:
        where = f"{module.path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, node.level, node.module)
            if target.split(".")[0] in roots:
                out.append(_ImportUse(target, tuple(a.name for a in node.names), where, context,
                                      guard))
        elif isinstance(node, ast.Import):
            out.extend(_ImportUse(a.name, (), where, context, guard)
                       for a in node.names if a.name.split(".")[0] in roots)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                handle(stmt, "type-only", guard)
            for stmt in node.orelse:
                handle(stmt, context, guard)
        elif isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            number = next(tries)
            for stmt in node.body:
                handle(stmt, context, (number, "try"))
            for stmt in [s for h in node.handlers for s in h.body]:
                handle(stmt, context, (number, "except"))
            for stmt in [*node.orelse, *node.finalbody]:
                handle(stmt, context, guard)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and context == "module":
            visit(node, "lazy", guard)
        else:
            visit(node, context, guard)

    visit(module.tree, "module", None)
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return bool({_dotted(t).rpartition(".")[2] for t in types} & {
        "ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def _missing(trees: SourceTrees, use: _ImportUse) -> list[str]:
    """What of ``use`` the target lacks (module or names); [] when all resolves.  A name is
    there when the module binds it at its top level (def, class, assignment, import, star
    import) or it is a submodule; a module with ``__getattr__`` or a compiled one is taken at
    its word."""
    module = trees.module(use.module)
    if module is None:
        return [use.module]
    if module.lazy_getattr:
        return []
    return [f"{use.module}.{name}" for name in use.names
            if name != "*" and not trees.binds(use.module, name)]


@functools.cache
def _kvpersist_modules() -> list[_Module]:
    """kvpersist's own modules (``testing/`` excepted), parsed from its files."""
    out = []
    for path in sorted(KVPERSIST_ROOT.rglob("*.py")):
        rel = path.relative_to(KVPERSIST_ROOT.parent)
        if rel.parts[1] == "testing":
            continue
        dotted = ".".join(rel.with_suffix("").parts)
        is_package = path.name == "__init__.py"
        out.append(_parse_module(dotted.removesuffix(".__init__"), rel.as_posix(), is_package,
                                 path.read_bytes()))
    return out


def _reachable(tree: SourceTree, start: Iterable[_ImportUse]) -> set[str]:
    """The modules of ``tree`` that importing ``start`` (and calling into it) may load: every
    import that can run (not ``TYPE_CHECKING`` ones), followed to a fixed point."""
    seen: set[str] = set()
    todo: list[str] = []

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in seen and tree.locate(name) is not None:
                seen.add(name)
                todo.append(name)

    def add_use(use: _ImportUse) -> None:
        if use.context == "type-only" or use.module.split(".")[0] != tree.package:
            return
        add(use.module)
        for name in use.names:
            add(f"{use.module}.{name}")

    for use in start:
        add_use(use)
    while todo:
        for use in tree.import_uses(todo.pop(), (tree.package,)):
            add_use(use)
    return seen


def _check_imports(trees: SourceTrees, lmcache: SourceTree) -> list[ApiFinding]:
    """Every vLLM/LMCache import of kvpersist and every vLLM import of LMCache's vLLM
    integration, resolved in the targets.  One that fails breaks when it can run in a module
    kvpersist loads (directly or through LMCache) and no alternative of its ``try`` resolves."""
    own = [u for m in _kvpersist_modules() for u in _import_uses(m, ("vllm", "lmcache"))]
    reachable = _reachable(lmcache, own)
    uses = [(u, True) for u in own]
    for path in lmcache.files(_LMCACHE_VLLM_INTEGRATION, recursive=True):
        module = lmcache.module(path.removesuffix(".py").removesuffix("/__init__")
                                .replace("/", "."))
        if module is not None:
            uses.extend((u, module.name in reachable) for u in _import_uses(module, ("vllm",)))
    missing = {id(use): _missing(trees, use) for use, _ in uses}
    failed: dict[tuple[str, int, str], bool] = {}  # (file, try, part) -> some import failed
    for use, _ in uses:
        if use.guard is not None:
            key = (use.where.rpartition(":")[0], *use.guard)
            failed[key] = failed.get(key, False) or bool(missing[id(use)])
    out = []
    for use, used in uses:
        lacking = missing[id(use)]
        if not lacking:
            continue
        severity: Severity = "info"
        if use.context == "type-only":
            why = "only under TYPE_CHECKING: never imported at run time"
        elif not used:
            why = "in an LMCache module kvpersist does not load"
        elif use.guard is not None and not failed.get(
                (use.where.rpartition(":")[0], use.guard[0],
                 "except" if use.guard[1] == "try" else "try"), False):
            file = use.where.rpartition(":")[0]
            other = "except" if use.guard[1] == "try" else "try"
            has_other = any(u.guard == (use.guard[0], other) and u.where.startswith(file + ":")
                            for u, _ in uses)
            why = ("its except branch imports an alternative that resolves" if
                   use.guard[1] == "try" and has_other else
                   "in a try whose except branch does without it" if use.guard[1] == "try" else
                   "in an except branch, never run: the import of its try resolves")
        else:
            severity = "breaks"
            why = ("at import: the module would not import" if use.context == "module"
                   else "inside a function: it fails when called")
        out.append(ApiFinding("import", use.where, severity,
                              f"{', '.join(lacking)} not found in the target ({why})"))
    return out


def connector_surface(trees: SourceTrees) -> dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]]:
    """vLLM's connector base classes as :data:`TESTED_CONNECTOR_SURFACE` records them."""
    out: dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]] = {}
    for name in _BASE_CLASSES:
        cls = trees.find(_BASE_MODULE, name)
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            continue
        methods: dict[str, tuple[str, bool, tuple[str, ...]]] = {}
        for member, node in _class_members(cls.node).items():
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (
                    member.startswith("_") and member != "__init__"):
                continue
            abstract = any(d.rpartition(".")[2] == "abstractmethod" for d in _decorators(node))
            methods[member] = (_method_kind(node), abstract, _params(node.args))
        out[name] = dict(sorted(methods.items()))
    return out


def _defined(cls: _Def | None) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The methods class ``cls`` defines itself."""
    if cls is None or not isinstance(cls.node, ast.ClassDef):
        return {}
    return {n: s for n, s in _class_members(cls.node).items()
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}


def _accepts(node: ast.FunctionDef | ast.AsyncFunctionDef, params: tuple[str, ...]) -> bool:
    """Whether an override takes the same parameters (or forwards ``*args, **kwargs``)."""
    own = _params(node.args)
    if any(p.startswith("*") and p != "*" and not p.startswith("**") for p in own) and any(
            p.startswith("**") for p in own):
        return True
    return own[1:] == params[1:]


def _kv_connector_classes() -> tuple[dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]],
                                     set[str]]:
    """kvpersist's connector classes (their own methods) and ``_OWN`` of kv_connector.py."""
    module = _parse_module("kvpersist.serving.connector.kv_connector",
                           _KV_CONNECTOR.relative_to(KVPERSIST_ROOT.parent).as_posix(), False,
                           _KV_CONNECTOR.read_bytes())
    classes: dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    own: set[str] = set()
    for name, binding in module.bindings.items():
        if binding.kind == "class":
            classes[name] = _defined(_Def(module, binding.node))
        elif name == "_OWN" and isinstance(binding.node, ast.Assign) and isinstance(
                binding.node.value, ast.Set):
            own = {e.value for e in binding.node.value.elts if isinstance(e, ast.Constant)
                   and isinstance(e.value, str)}
    return classes, own


def _check_surface(trees: SourceTrees) -> list[ApiFinding]:
    target = connector_surface(trees)
    out: list[ApiFinding] = []
    if not target.get("KVConnectorBase_V1"):
        return [ApiFinding("base-class", f"{_BASE_MODULE}.KVConnectorBase_V1", "breaks",
                           "vLLM's connector base class is not in the target")]
    classes, own_names = _kv_connector_classes()
    kvp = classes.get("KvPersistConnector", {})
    disabled = classes.get("DisabledKvConnector", {})
    overriders = {
        "kvpersist's KvPersistConnector": kvp,
        "kvpersist's DisabledKvConnector": disabled,
        "kvpersist's NamespacedLMCacheConnector": classes.get("NamespacedLMCacheConnector", {}),
        "LMCache's LMCacheMPConnector": _defined(trees.find(*_LMCACHE_CONNECTOR)),
    }
    lmcache_defines = overriders["LMCache's LMCacheMPConnector"]
    for base in _BASE_CLASSES:
        tested, now = TESTED_CONNECTOR_SURFACE.get(base, {}), target.get(base, {})
        if not now:
            out.append(ApiFinding("base-class", f"{_BASE_MODULE}.{base}", "breaks",
                                  "the class is not in the target"))
            continue
        for name in sorted(set(tested) | set(now)):
            qual = f"{base}.{name}"
            old, new = tested.get(name), now.get(name)
            if new is None:
                assert old is not None
                users = [who for who, defs in overriders.items() if name in defs]
                # kvpersist's own logic (the handshake, the scheduler side) would never run;
                # LMCache's override not either; DisabledKvConnector's no-op does not matter
                relied = name in own_names or any(
                    name in overriders[who] for who in ("kvpersist's KvPersistConnector",
                                                        "kvpersist's NamespacedLMCacheConnector"))
                severity: Severity = "breaks" if relied else "degrades" if name in \
                    lmcache_defines else "info"
                out.append(ApiFinding(
                    "removed", qual, severity,
                    "vLLM no longer calls it" + (f"; overridden by {', '.join(users)}, "
                                                 "which is then never called" if users else "")))
                continue
            if old is None:
                out.append(_added(qual, name, new, kvp, own_names, overriders, lmcache_defines))
                continue
            if new[1] and not old[1]:
                lacking = [who for who in ("kvpersist's DisabledKvConnector",
                                           "LMCache's LMCacheMPConnector")
                           if name not in overriders[who]]
                out.append(ApiFinding(
                    "abstract-added", qual, "breaks" if lacking else "info",
                    "now abstract" + (f"; not implemented by {', '.join(lacking)}: it cannot "
                                      "be instantiated" if lacking else "")))
            elif old[1] and not new[1]:
                out.append(ApiFinding("abstract-removed", qual, "info",
                                      "no longer abstract (a default implementation exists)"))
            if old[0] != new[0]:
                out.append(ApiFinding("kind-changed", qual, "breaks" if any(
                    name in d for d in overriders.values()) else "info",
                    f"was a {old[0]}, now a {new[0]}"))
            if old[2] != new[2]:
                wrong = [who for who, defs in overriders.items()
                         if name in defs and not _accepts(defs[name], new[2])]
                right = [who for who, defs in overriders.items()
                         if name in defs and who not in wrong]
                detail = (f"parameters ({', '.join(old[2])}) -> ({', '.join(new[2])})")
                if wrong:
                    detail += f"; overridden with other parameters by {', '.join(wrong)}"
                if right:
                    detail += f"; taken as before by {', '.join(right)}"
                if name not in kvp and name not in own_names and new[0] in ("method",
                                                                             "property"):
                    detail += "; KvPersistConnector forwards it with *args, **kwargs"
                out.append(ApiFinding("params-changed", qual, "breaks" if wrong else "info",
                                      detail))
    return out


def _added(qual: str, name: str, new: tuple[str, bool, tuple[str, ...]],
           kvp: dict[str, Any], own_names: set[str],
           overriders: dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]],
           lmcache_defines: dict[str, Any]) -> ApiFinding:
    """A method the tested vLLM's base class did not have."""
    kind, abstract, params = new
    sig = f"{kind} ({', '.join(params)})"
    lmc = name in lmcache_defines
    lacking = [who for who in ("kvpersist's DisabledKvConnector", "LMCache's LMCacheMPConnector")
               if name not in overriders[who]]
    if abstract and lacking:
        return ApiFinding("added", qual, "breaks",
                          f"new abstract {sig}; not implemented by {', '.join(lacking)}: it "
                          "cannot be instantiated")
    if kind in ("classmethod", "staticmethod"):
        if name in kvp:
            return ApiFinding("added", qual, "info", f"new {sig}; KvPersistConnector defines it")
        if lmc:
            return ApiFinding("added", qual, "degrades",
                              f"new {sig}, not forwarded (class-level API): vLLM gets the base "
                              "default, not LMCacheMPConnector's override")
        return ApiFinding("added", qual, "info",
                          f"new {sig}, not forwarded (class-level API); LMCache does not "
                          "override it either, so the base default applies as with LMCache")
    if name in kvp or name in own_names:
        return ApiFinding("added", qual, "info", f"new {sig}; KvPersistConnector defines it")
    return ApiFinding("added", qual, "info",
                      f"new {sig}; forwarded to the inner connector automatically, where "
                      + ("LMCacheMPConnector overrides it" if lmc else
                         "the base default runs (LMCacheMPConnector does not override it)"))


# ---------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class CompatReport:
    """What kvpersist would do with these vLLM and LMCache distributions.

    Invariants: ``gate_reasons`` lists exactly what closes the connector's gate at run time
    (each ``unsafe_without`` feature that is off, and unclassified engine fields);
    ``breaking`` the API findings that keep the connector from loading or working; a feature is
    on exactly when all its pinned sources match.
    """

    vllm: DistributionInfo
    lmcache: DistributionInfo
    features: tuple[FeatureResult, ...]
    engine_fields: EngineFields
    api: tuple[ApiFinding, ...]

    @property
    def gate_reasons(self) -> tuple[str, ...]:
        reasons = [f"fence feature {f.name} is off ({f.if_off})" for f in self.features
                   if f.unsafe_without and not f.on]
        unknown = self.engine_fields.unknown
        if unknown:
            reasons.append(f"{len(unknown)} engine field(s) kvpersist never classified: "
                           + ", ".join(unknown))
        if self.engine_fields.unresolved:
            reasons.append("engine configuration not readable: "
                           + ", ".join(self.engine_fields.unresolved))
        return tuple(reasons)

    @property
    def gate_closes(self) -> bool:
        return bool(self.gate_reasons)

    @property
    def breaking(self) -> tuple[ApiFinding, ...]:
        return tuple(f for f in self.api if f.severity == "breaks")

    @property
    def features_off(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features if not f.on)

    @property
    def exit_code(self) -> int:
        """2: caching would not run (gate closes, or the connector breaks); 1: it runs with a
        feature off or an API difference that degrades it; 0: everything on."""
        if self.gate_closes or self.breaking:
            return 2
        if self.features_off or any(f.severity == "degrades" for f in self.api):
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(gate_closes=self.gate_closes, gate_reasons=list(self.gate_reasons),
                    features_off=list(self.features_off), exit_code=self.exit_code,
                    tested_versions=dict(lmcache_pins.TESTED_VERSIONS))
        return data

    def lines(self) -> Iterator[str]:
        """The report as text, most important first."""
        verdict = {0: "OK: every feature on, the gate stays open",
                   1: "DEGRADED: caching runs, with less",
                   2: "CLOSED: caching would not run"}[self.exit_code]
        yield f"compat: {verdict}"
        for dist in (self.vllm, self.lmcache):
            tested = lmcache_pins.TESTED_VERSIONS.get(dist.package)
            yield (f"  {dist.package} {dist.version or '(version unknown)'} at {dist.location}"
                   + ("" if dist.version == tested else f" (tested: {tested})"))
        if not self.gate_reasons:
            yield "  gate: stays open"
        for reason in self.gate_reasons:
            yield f"  gate closes: {reason}"
        for finding in self.breaking:
            yield f"  breaks: {finding.name}: {finding.detail}"
        yield ""
        yield "fence features:"
        for f in self.features:
            state = "on" if f.on else "OFF" + (" (closes the gate)" if f.unsafe_without else "")
            yield f"  {f.name:16} {state}"
            for c in f.changed:
                yield f"      changed: {c.module}.{c.qualname} (pinned {c.pinned}, found {c.found})"
            if not f.on:
                yield f"      without it: {f.if_off}"
        yield ""
        ef = self.engine_fields
        yield (f"engine fields: {ef.count} read, {len(ef.unknown)} unknown, {len(ef.stale)} "
               "stale")
        for name in ef.unknown:
            yield f"  unknown (closes the gate): {name}"
        for name in ef.stale:
            yield f"  stale (no longer in vLLM): {name}"
        for name in ef.unresolved:
            yield f"  unreadable: {name}"
        yield ""
        yield f"connector API: {len(self.api)} finding(s)"
        for finding in sorted(self.api, key=lambda f: ("breaks", "degrades", "info").index(
                f.severity)):
            yield f"  [{finding.severity}] {finding.kind} {finding.name}: {finding.detail}"


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


def check(vllm: DistributionPath | None = None, lmcache: DistributionPath | None = None
          ) -> CompatReport:
    """Check kvpersist against a vLLM and an LMCache distribution (default: the installed
    ones).  Raises :class:`CompatError` when a distribution cannot be read."""
    trees = trees_for(vllm, lmcache)
    try:
        vllm_tree, lmcache_tree = trees.by_package["vllm"], trees.by_package["lmcache"]
        api = [*_check_imports(trees, lmcache_tree), *_check_surface(trees)]
        return CompatReport(vllm_tree.info, lmcache_tree.info, _check_features(trees),
                            _check_engine_fields(trees), tuple(api))
    finally:
        trees.close()


@functools.cache
def check_installed() -> CompatReport:
    """:func:`check` for the installed versions, once per process (for preflight)."""
    return check()


def trees_for(vllm: DistributionPath | None = None, lmcache: DistributionPath | None = None
              ) -> SourceTrees:
    """The parsed trees :func:`check` reads (for tests and tools that look closer)."""
    vllm_tree = SourceTree("vllm", vllm if vllm is not None else installed_location("vllm"))
    try:
        lmcache_tree = SourceTree("lmcache", lmcache if lmcache is not None
                                  else installed_location("lmcache"))
    except BaseException:
        vllm_tree.close()
        raise
    return SourceTrees(vllm_tree, lmcache_tree)
