"""Names resolved across modules and distributions, as the import system and ``getattr`` would
find them at run time, from the parsed source alone.

Invariants
----------
* A name resolves to the binding that runs last in its module, following ``from`` imports,
  ``import``, star imports, plain aliases (``X = Y``) and submodules of packages; a name
  outside the trees read together resolves to None.
* Methods are found through the class's bases depth first (a simple MRO); recursion is bounded,
  so a cycle of imports or bases ends in None, never a hang.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .parsing import _class_members, _Module
from .sources import SourceTree


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
