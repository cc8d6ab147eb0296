"""Layer views of the KV cache after LMCache's real CPU migration to shared memory: an MLA layer
binds ``kv_cache.squeeze(1)`` (vLLM's ``MLAAttention.bind_kv_cache``), a view LMCache does not
re-point, so the layer computed on private memory the server never maps (every MLA model
restored wrong tokens).  After :func:`repoint_stale_views` the layer and the server's mapping are
the same bytes, both ways."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap

from kvpersist.serving.lmcache_compat import kv_views

BLOCKS, BLOCK, LATENT = 4, 16, 576  # vLLM CPU MLA: [blocks, 1, block, kv_lora_rank + rope]


def engine(layers: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, SimpleNamespace]]:
    """An engine's KV caches and its layers bound as vLLM binds MLA layers (before registration)."""
    kv_caches = {f"model.layers.{i}.self_attn.attn":
                 torch.zeros(BLOCKS, 1, BLOCK, LATENT, dtype=torch.bfloat16) for i in range(layers)}
    bound = {name: SimpleNamespace(kv_cache=t.squeeze(1), weight=torch.nn.Parameter(t.clone()))
             for name, t in kv_caches.items()}
    return kv_caches, bound


def register(kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LMCache's CPU registration: migrate each tensor, and the server's mapping of it."""
    wrappers = {name: migrate_to_shm_and_wrap(t) for name, t in kv_caches.items()}
    return {name: w.to_tensor() for name, w in wrappers.items()}


@pytest.mark.parametrize("repoint", [True, False], ids=["repointed", "as LMCache leaves it"])
def test_an_mla_layer_view_and_the_server_see_the_same_bytes_only_once_repointed(
        repoint: bool) -> None:
    kv_caches, layers = engine()
    before = kv_views.storage_pointers(kv_caches)
    server = register(kv_caches)
    moved = kv_views.moved_storages(before, kv_caches)
    assert len(moved) == len(kv_caches)  # every storage went to shared memory
    assert sorted(kv_views.stale_views(layers, moved)) == sorted(
        f"{name}.kv_cache" for name in layers)
    if repoint:
        assert len(kv_views.repoint_stale_views(layers, moved)) == len(layers)
        assert kv_views.stale_views(layers, moved) == []
    name = next(iter(layers))
    # the model writes a token's latent KV through its layer view (a store reads it)
    layers[name].kv_cache[2, 5] = torch.arange(LATENT, dtype=torch.bfloat16)
    # a restore writes another block into the server's mapping (the model reads it)
    server[name][1, 0, 7] = 3.0
    seen_by_server = torch.equal(server[name][2, 0, 5], torch.arange(LATENT, dtype=torch.bfloat16))
    seen_by_model = bool((layers[name].kv_cache[1, 7] == 3.0).all())
    assert seen_by_server is repoint and seen_by_model is repoint


def test_parameters_and_unmoved_storages_are_left_alone() -> None:
    kv_caches, layers = engine(1)
    before = kv_views.storage_pointers(kv_caches)
    assert kv_views.moved_storages(before, kv_caches) == {}  # nothing registered, nothing moved
    name = next(iter(layers))
    weight_ptr = layers[name].weight.data_ptr()
    register(kv_caches)
    moved = kv_views.moved_storages(before, kv_caches)
    kv_views.repoint_stale_views(layers, moved)
    assert layers[name].weight.data_ptr() == weight_ptr


def test_a_tensor_in_a_list_attribute_and_the_engine_s_own_dict_are_repointed() -> None:
    kv_caches, _ = engine(1)
    name, tensor = next(iter(kv_caches.items()))
    layers = {name: SimpleNamespace(kv_cache=[tensor.squeeze(1)]),
              "engine": kv_views.TensorBag({name: tensor[:2]})}
    before = kv_views.storage_pointers(kv_caches)
    register(kv_caches)
    moved = kv_views.moved_storages(before, kv_caches)
    assert sorted(kv_views.repoint_stale_views(layers, moved)) == sorted(
        [f"{name}.kv_cache[0]", f"engine.{name}"])
    assert kv_views.stale_views(layers, moved) == []
