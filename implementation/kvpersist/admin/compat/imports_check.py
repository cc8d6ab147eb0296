"""Every ``vllm``/``lmcache`` import of kvpersist's own code (``testing/`` excepted) and every
``vllm`` import of LMCache's vLLM integration modules, resolved in the target trees.

Invariants
----------
* A missing import ``breaks`` only when it can run in a module kvpersist loads (directly or
  through LMCache) and no alternative of its ``try`` resolves; ``TYPE_CHECKING`` imports, LMCache
  modules kvpersist never loads and guarded imports with a working alternative are ``info``.
* A name is there when the module binds it at its top level or it is a submodule; a module with
  ``__getattr__`` or a compiled one is taken at its word.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from .connector_api import ApiFinding, Severity
from .import_uses import _import_uses, _ImportUse
from .parsing import _Module, _parse_module
from .resolve import SourceTrees
from .sources import KVPERSIST_ROOT, SourceTree

_LMCACHE_VLLM_INTEGRATION = "lmcache/integration/vllm"


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
