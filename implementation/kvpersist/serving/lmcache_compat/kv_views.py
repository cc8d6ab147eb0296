"""Layer views of a CPU engine's KV cache that LMCache's move to shared memory left behind.

On a CPU host LMCache's connector moves each registered KV tensor's backing storage into a
``/dev/shm`` segment (so its server can map it) and re-points *the tensors it was handed*
(``tensor.set_``); any other tensor on the old storage keeps pointing at the old, private
memory.  vLLM binds its layers before it registers the caches, and some layers keep a tensor of
their own: MLA's ``bind_kv_cache`` stores ``kv_cache.squeeze(1)``, a new view.  Such a layer
then writes its KV where the server never reads, and reads none of what a restore wrote: every
MLA model restored wrong tokens (measured, DeepSeek-V2 style) before this module existed.  A
CUDA engine is not affected: LMCache maps the engine's own allocation there, nothing moves.

Invariants
----------
* :func:`repoint_stale_views` re-points every tensor attribute (or tensor in a list or tuple
  attribute) of every layer whose storage is one a registered tensor moved away from, onto that
  tensor's new storage, with its own offset, shape and stride: the move copied the whole
  storage, so every offset means the same bytes in both.  Parameters are never touched.
* Afterwards no layer tensor is on a moved-from storage; :func:`stale_views` says which are,
  for the check that follows (an engine with one left is not cached).
* Nothing is done when no storage moved (a GPU engine, or a migration that kept its storage).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def storage_pointers(kv_caches: Mapping[str, Any]) -> dict[str, int]:
    """Layer name -> data pointer of its KV tensor's storage (taken before registration)."""
    return {name: int(t.untyped_storage().data_ptr()) for name, t in kv_caches.items()}


class TensorBag:
    """Named tensors walked like a layer's attributes (the engine's own KV-cache dict)."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self.__dict__.update(tensors)


def moved_storages(before: Mapping[str, int], registered: Mapping[str, Any]) -> dict[int, Any]:
    """Old storage pointer -> the storage the registered tensor of the same layer is on now,
    for those that moved."""
    moved: dict[int, Any] = {}
    for name, old in before.items():
        if name not in registered:
            continue
        storage = registered[name].untyped_storage()
        if int(storage.data_ptr()) != old:
            moved[old] = storage
    return moved


def _layer_tensors(layers: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    import torch

    for layer_name, layer in layers.items():
        for attr, value in list(getattr(layer, "__dict__", {}).items()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for index, item in enumerate(items):
                if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter):
                    where = f"{layer_name}.{attr}" + (f"[{index}]" if items is value else "")
                    yield where, item


def stale_views(layers: Mapping[str, Any], moved: Mapping[int, Any]) -> list[str]:
    """The layer tensors still on a moved-from storage."""
    return [where for where, t in _layer_tensors(layers)
            if t.numel() and int(t.untyped_storage().data_ptr()) in moved]


def repoint_stale_views(layers: Mapping[str, Any], moved: Mapping[int, Any]) -> list[str]:
    """Re-point every stale layer tensor onto its storage's new home; returns which were."""
    done = []
    for where, t in _layer_tensors(layers):
        if not t.numel():
            continue
        storage = moved.get(int(t.untyped_storage().data_ptr()))
        if storage is None:
            continue
        t.set_(storage, t.storage_offset(), t.size(), t.stride())
        done.append(where)
    return done
