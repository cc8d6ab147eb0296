"""One module's source read as Python would run it, without importing it: its top-level
bindings, a class body's members, and what a ``def``'s decorators and parameters say.

Invariants
----------
* Only syntax is read: nothing here resolves a name in another module
  (:mod:`.resolve` does) and nothing is imported or executed.
* A binding is what runs: ``if TYPE_CHECKING:`` bodies are skipped (their ``else`` kept), every
  branch of another ``if``, ``try``, ``with`` and loop counts, and the last binding of a name
  wins, as at run time.
* :func:`_source_lines` gives the lines as ``linecache`` (and so ``inspect``) holds them, so
  source cut from them digests as the run-time pins do.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal


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
