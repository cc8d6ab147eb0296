"""The installed vLLM's engine configuration, field by field, against kvpersist's classification
(:mod:`kvpersist.identity.engine_fields`): the contract that no field goes unclassified.

Invariants
----------
* Every field name is spelled as the classification spells it (``<VllmConfig field>.<sub-config
  field>``, a top-level field by its own name, and the fields of the nested configs in
  :data:`NESTED`).
* A field the table does not know turns caching off in the engine that has it
  (:func:`unknown_fields_reason`, asked by the connector before its gate opens): the tests catch
  it in this repository, and an installation on a vLLM they never ran against serves uncached
  rather than with a knob nobody decided.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from collections.abc import Iterator
from typing import Any

from ...identity.engine_fields import ENGINE_FIELDS, expected_absent
from . import pins


def _config_class(annotation: Any) -> type | None:
    """The dataclass a ``VllmConfig`` field holds (``X`` or ``X | None``), or None."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


#: Sub-configs nested one level further whose fields are classified one by one.
NESTED = {"model_config.multimodal_config": "vllm.config.multimodal.MultiModalConfig"}


def engine_field_names() -> Iterator[str]:
    """Every field name of the installed vLLM's ``VllmConfig``, as the table spells them."""
    from vllm.config import VllmConfig

    hints = typing.get_type_hints(VllmConfig)
    for top in dataclasses.fields(VllmConfig):
        cls = _config_class(hints.get(top.name))
        if cls is None:
            yield top.name
            continue
        for sub in dataclasses.fields(cls):
            yield f"{top.name}.{sub.name}"
    for prefix, dotted in NESTED.items():
        module, _, name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for sub in dataclasses.fields(cls):
            yield f"{prefix}.{sub.name}"


def unclassified() -> list[str]:
    """The installed vLLM's configuration fields that have no entry in :data:`ENGINE_FIELDS`."""
    return [name for name in engine_field_names() if name not in ENGINE_FIELDS]


def stale_entries() -> list[str]:
    """Entries of :data:`ENGINE_FIELDS` that the installed vLLM no longer has (an entry a
    later vLLM release added is expected absent, not stale)."""
    present = set(engine_field_names())
    version = pins.installed_versions()["vllm"]
    return [name for name in ENGINE_FIELDS
            if name not in present and not expected_absent(name, version)]




@functools.cache
def unknown_fields_reason() -> str | None:
    """Why caching must stay off in this process because the installed vLLM has configuration
    fields kvpersist never classified (each named, at most ten), or None.  Asked once."""
    unknown = unclassified()
    if not unknown:
        return None
    shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10
                                       else "")
    return (f"the installed vLLM has engine settings kvpersist never classified ({shown}): "
            "whether they change the KV is unknown")
