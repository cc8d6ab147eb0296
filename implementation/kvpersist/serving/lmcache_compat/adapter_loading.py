"""The LMCache server imports only the L2 adapter modules its command line names.

LMCache 0.5.6 registers its ~20 built-in adapter modules lazily, but its server's argument
parser lists every adapter type in ``--l2-adapter``'s help text, and listing them imports them
all: Bigtable's Google client, S3's awscrt, NIXL, Mooncake and the rest.  Measured here: 3 of a
server start's 5 s (2.2 s with this module), paid at every start and restart of the cache
service, and by the test suite some 200 times.

Invariants
----------
* Every adapter type a ``--l2-adapter`` names resolves exactly as in LMCache: its module
  ``lmcache.v1.distributed.l2_adapters.<type>_l2_adapter`` is imported before the parser asks
  (that import registers the type, as LMCache's own search would); a type with no module of
  that name is left to LMCache's search, which may import the others.
* The help text's list of types is built from what is registered and the module names still
  pending, without importing them; with ``-h``/``--help`` on the command line nothing is
  changed (the full list, as LMCache prints it).
* Installed only while the pinned sources match (feature ``adapter_loading``); otherwise the
  server starts as LMCache does, only slower.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Sequence
from typing import Any

from . import pins
from .adapters import require

PACKAGE = "lmcache.v1.distributed.l2_adapters"
SUFFIX = "_l2_adapter"
HELP_FLAGS = frozenset({"-h", "--help"})


def adapter_types(adapter_values: Iterable[Any]) -> list[str]:
    """The ``type`` of every parsed ``--l2-adapter`` value that has one (in order, once)."""
    types: list[str] = []
    for value in adapter_values:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind and kind not in types:
            types.append(kind)
    return types


def module_of(adapter_type: str) -> str | None:
    """LMCache's module for ``adapter_type`` when one of that name ships, else None."""
    if not adapter_type.replace("_", "").isalnum():
        return None
    name = f"{PACKAGE}.{adapter_type}{SUFFIX}"
    return name if importlib.util.find_spec(name) is not None else None


def listed_types() -> list[str]:
    """The registered adapter types and those of the modules still pending, none imported."""
    factory = importlib.import_module(f"{PACKAGE}.factory")
    pending = {path.rsplit(".", 1)[-1].removesuffix(SUFFIX)
               for path in require(factory, "_PENDING_MODULES")}
    return sorted(set(require(factory, "_L2_ADAPTER_FACTORY_REGISTRY")) | pending)


def install(lmcache_args: Sequence[str], adapter_values: Iterable[Any]) -> bool:
    """Import the named adapters' modules and make the help listing import-free (see module
    invariants); False when nothing was changed (help asked for, or the pins differ)."""
    if HELP_FLAGS.intersection(lmcache_args) or not pins.available("adapter_loading"):
        return False
    for adapter_type in adapter_types(adapter_values):
        module = module_of(adapter_type)
        if module is not None:
            importlib.import_module(module)
    config = importlib.import_module(f"{PACKAGE}.config")
    setattr(config, "get_registered_l2_adapter_types", listed_types)  # noqa: B010
    return True
