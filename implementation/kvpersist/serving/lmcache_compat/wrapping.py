"""Replacing an LMCache method by a wrapper that calls it, keeping what LMCache reads of it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap_method(cls: Any, name: str,
                make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Set ``cls.name`` to ``make(original)``; ``functools.update_wrapper`` keeps the
    original's attributes (LMCache's request-handler options among them) and ``__wrapped__``."""
    original = getattr(cls, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(cls, name, wrapper)
