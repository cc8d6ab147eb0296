"""Which imports a parsed module makes, and when each runs: at its import, inside a function,
never (``if TYPE_CHECKING:``), or as one side of a ``try`` that catches ``ImportError``.

Invariants
----------
* Only statements are walked (imports are statements), never expressions; a nested ``def``
  makes its imports ``lazy``, a ``TYPE_CHECKING`` body ``type-only``.
* Relative imports are made absolute against the importing module (:func:`.parsing._absolute`),
  so a use names the module exactly as ``import`` would look it up.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal

from .parsing import _absolute, _dotted, _is_type_checking, _Module

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
