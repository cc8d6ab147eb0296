"""The fence's pins (:data:`kvpersist.serving.lmcache_compat.pins.FEATURES`) checked against the
target's files: each pinned function's source is cut out of its file as ``inspect.getsource``
would give it for the undecorated function and digested as
:func:`~kvpersist.serving.lmcache_compat.pins.source_digest` does.

Invariants
----------
* A digest is computed from exactly the text ``inspect.getsource`` would return (decorator
  lines included, a method's indentation kept), so on the tested versions it equals the pin.
* A function that is gone, a property or a non-function digests as ``missing``, as
  ``inspect.getsource`` fails on those.
* A feature is on exactly when none of its pinned functions changed.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from dataclasses import dataclass

from ...serving.lmcache_compat import pins as lmcache_pins
from .parsing import _method_kind, _Module
from .resolve import SourceTrees


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
