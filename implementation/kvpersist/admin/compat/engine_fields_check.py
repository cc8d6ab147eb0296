"""vLLM's engine configuration read from source: ``VllmConfig``'s dataclass fields, one level
into each sub-config dataclass, plus
:data:`~kvpersist.serving.lmcache_compat.engine_config.NESTED`, compared with
:data:`~kvpersist.identity.engine_fields.ENGINE_FIELDS`.

Invariants
----------
* The names are spelled and ordered as
  :func:`~kvpersist.serving.lmcache_compat.engine_config.engine_field_names` gives them at run
  time (``dataclasses.fields`` order: dataclass bases first, a redefinition keeping its place;
  ``ClassVar``/``InitVar``/``KW_ONLY`` make no field).
* A field ``ENGINE_FIELDS`` does not classify is ``unknown`` (it closes the gate); an entry the
  target no longer has is ``stale``; a config class that cannot be read is ``unresolved``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ...identity.engine_fields import ENGINE_FIELDS, expected_absent
from ...serving.lmcache_compat import engine_config
from .parsing import _decorators, _dotted, _Module
from .resolve import SourceTrees, _Def


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
    version = trees.by_package["vllm"].info.version
    return EngineFields(len(names), tuple(n for n in names if n not in ENGINE_FIELDS),
                        tuple(n for n in ENGINE_FIELDS
                              if n not in present and not expected_absent(n, version)),
                        tuple(unresolved))
