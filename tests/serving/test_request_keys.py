"""Per-request keys: a LoRA adapter is folded into the salt by content, a request that cannot be
keyed is neither looked up nor stored, and multimodal items change LMCache's token keys."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpersist.serving.connector.request_keys import (
    RESERVED_PREFIX,
    RequestKeys,
    Uncacheable,
    adapter_tag_of_salt,
    request_salt,
)

A = "a" * 64
B = "b" * 64


def adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def lora_request(path: Path, name: str = "a", int_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


def request(lora: SimpleNamespace | None = None, salt: str | None = None,
            prompt_embeds: object = None) -> SimpleNamespace:
    return SimpleNamespace(lora_request=lora, cache_salt=salt, prompt_embeds=prompt_embeds)


def test_a_request_without_an_adapter_keeps_its_salt() -> None:
    assert request_salt("", None) == ""
    assert request_salt("team-a", None) == "team-a"


def test_derived_salts_are_apart_from_each_other_and_from_user_salts() -> None:
    salts = {request_salt(s, d) for s in ("", "team-a") for d in (A, B)}
    assert len(salts) == 4 and all(s.startswith(RESERVED_PREFIX) for s in salts)
    # a user who types a derived salt does not get that adapter's KV: reserved salts are derived
    forged = request_salt("", A)
    assert request_salt(forged, None) not in (forged, "")
    assert request_salt(forged, None).startswith(RESERVED_PREFIX + "base-")
    assert adapter_tag_of_salt(request_salt("", A)) == A[:12]
    assert adapter_tag_of_salt("team-a") is None
    assert all(len(s) <= 64 and "@" not in s and ".tmp." not in s for s in salts)


def test_an_adapter_is_keyed_by_its_content_not_its_name(tmp_path: Path) -> None:
    keys = RequestKeys({"lora_dtype": "auto"})
    one = adapter(tmp_path / "one", b"\x01" * 64)
    same_bytes = adapter(tmp_path / "renamed", b"\x01" * 64)
    other = adapter(tmp_path / "other", b"\x02" * 64)
    salt_one = keys.salt(request(lora_request(one, "a", 1)))
    assert isinstance(salt_one, str) and salt_one.startswith(RESERVED_PREFIX + "lora")
    assert keys.salt(request(lora_request(same_bytes, "b", 2))) == salt_one
    assert keys.salt(request(lora_request(other, "a", 3))) != salt_one
    assert keys.salt(request(lora_request(one, "a", 1), salt="x")) != salt_one
    assert keys.salt(request()) == ""
    # the engine's LoRA settings that change the computation are part of the key
    assert RequestKeys({"lora_dtype": "bfloat16"}).salt(request(lora_request(one))) != salt_one


def test_an_adapter_changed_after_keying_is_not_cached(tmp_path: Path) -> None:
    keys = RequestKeys(None)
    folder = adapter(tmp_path / "a", b"\x01" * 64)
    assert isinstance(keys.salt(request(lora_request(folder))), str)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(b"\x03" * 64)
    os.utime(weights, ns=(1, 1))
    verdict = keys.salt(request(lora_request(folder)))
    assert isinstance(verdict, Uncacheable) and verdict.reason == "lora_changed"
    # even when the files go back, the engine may hold either version: still not cached
    assert isinstance(keys.salt(request(lora_request(folder))), Uncacheable)


@pytest.mark.parametrize(("req", "reason"), [
    (request(prompt_embeds=object()), "prompt_embeds"),
    (request(lora_request(Path("/nonexistent/adapter"))), "lora_not_local"),
    (request(SimpleNamespace(lora_name="hub", lora_int_id=4, lora_path="org/adapter")),
     "lora_not_local"),
])
def test_requests_that_cannot_be_keyed_are_uncacheable(req: SimpleNamespace, reason: str) -> None:
    verdict = RequestKeys(None).salt(req)
    assert isinstance(verdict, Uncacheable) and verdict.reason == reason


def mm_request(image_hash: str) -> SimpleNamespace:
    """A vLLM request with one image: placeholder tokens 9 at positions 4..11."""
    from vllm.multimodal.inputs import PlaceholderRange

    prompt = [1, 2, 3, 4] + [9] * 8 + [5, 6]
    feature = SimpleNamespace(identifier=image_hash, mm_position=PlaceholderRange(4, 8))
    return SimpleNamespace(request_id="r", cache_salt=None, prompt_token_ids=prompt,
                           all_token_ids=list(prompt), num_prompt_tokens=len(prompt),
                           mm_features=[feature], sampling_params=None, lora_request=None,
                           prompt_embeds=None)


def test_a_multimodal_request_s_key_differs_with_the_image() -> None:
    """LMCache's own tracker (pinned by the request_keys feature) substitutes the image's
    content hash for its placeholder tokens, which is what the keys are made of."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestTracker

    one = LMCacheMPRequestTracker(mm_request("img-one")).get_token_ids()
    again = LMCacheMPRequestTracker(mm_request("img-one")).get_token_ids()
    two = LMCacheMPRequestTracker(mm_request("img-two")).get_token_ids()
    assert one == again
    assert one != two
    assert one[:4] == two[:4] == [1, 2, 3, 4] and one[12:] == two[12:] == [5, 6]
    assert one[4:12] != [9] * 8


# --- multimodal items keyed by content, never by vLLM's identifier (a label)


def image_feature(pixels: object, identifier: str) -> object:
    """vLLM's real feature spec for one image whose processed inputs are ``pixels``."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    item = None if pixels is None else MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())})
    return MultiModalFeatureSpec(data=item, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(4, 8), mm_hash=identifier)


def image_request(pixels: object, identifier: str, salt: str | None = None) -> SimpleNamespace:
    req = mm_request(identifier)
    req.mm_features = [image_feature(pixels, identifier)]
    req.cache_salt = salt
    return req


def lmcache_key(req: SimpleNamespace, keys: RequestKeys) -> tuple[tuple[int, ...], str]:
    """What LMCache keys the request's chunks by: its tracker's token IDs (placeholders
    replaced from the identifier) and the salt kvpersist gives the tracker."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestTracker

    salt = keys.salt(req)
    assert isinstance(salt, str), salt
    return tuple(LMCacheMPRequestTracker(req).get_token_ids()), salt


def test_an_image_is_keyed_by_its_content_not_by_vllm_s_counter_or_a_client_uuid() -> None:
    import torch

    keys = RequestKeys(None)
    image_a = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    image_b = image_a.clone()
    image_b[3, 11] += 1.0  # one value differs
    # vLLM without prefix caching and processor cache: a counter that restarts every launch
    counter = "renderer0-mm-1-image-0"
    assert lmcache_key(image_request(image_a, counter), keys) != lmcache_key(
        image_request(image_b, counter), keys)
    # a client's uuid, reused for other bytes: no hit across them
    assert lmcache_key(image_request(image_a, "my-uuid"), keys) != lmcache_key(
        image_request(image_b, "my-uuid"), keys)
    # the same bytes under two labels share the salt (what the engine computed with is equal)
    assert keys.salt(image_request(image_a, "my-uuid")) == keys.salt(
        image_request(image_a.clone(), counter))
    # another tenant's salt never reaches this one's KV, whatever uuid it sends
    assert keys.salt(image_request(image_a, "my-uuid", salt="tenant-a")) != keys.salt(
        image_request(image_a, "my-uuid", salt="tenant-b"))
    derived = keys.salt(image_request(image_a, counter))
    assert isinstance(derived, str) and derived.startswith(RESERVED_PREFIX + "mm-")


def test_dtype_shape_and_position_are_part_of_an_image_s_key() -> None:
    import torch

    keys = RequestKeys(None)
    base = torch.zeros(4, 12)
    salts = {keys.salt(image_request(t, "x")) for t in
             (base, base.to(torch.bfloat16), base.reshape(12, 4), base.reshape(1, 4, 12))}
    assert len(salts) == 4
    moved = image_request(base, "x")
    from vllm.multimodal.inputs import PlaceholderRange

    moved.mm_features[0].mm_position = PlaceholderRange(5, 8)
    assert keys.salt(moved) not in salts


@pytest.mark.parametrize("pixels", [None, {"address": 4096, "monotonic_id": 7}])
def test_an_image_without_inputs_the_scheduler_can_digest_is_not_cached(pixels: object) -> None:
    req = image_request(None, "renderer0-mm-1-image-0")
    if pixels is not None:  # vLLM's shm processor cache hands the scheduler a handle
        req.mm_features[0].data = pixels
    verdict = RequestKeys(None).salt(req)
    assert isinstance(verdict, Uncacheable) and verdict.reason == "mm_no_content"


# --- adapters whose weights may differ from what a digest says


def test_an_adapter_id_reused_for_another_folder_is_not_cached(tmp_path: Path) -> None:
    keys = RequestKeys(None)
    voided: list[int] = []
    keys.on_adapter_void = voided.append
    one = adapter(tmp_path / "one", b"\x01" * 64)
    two = adapter(tmp_path / "two", b"\x02" * 64)
    assert isinstance(keys.salt(request(lora_request(one, "a", 1))), str)
    # the offline API reuses id 1 for another adapter: vLLM's workers may keep serving "a"
    verdict = keys.salt(request(lora_request(two, "b", 1)))
    assert isinstance(verdict, Uncacheable) and verdict.reason == "lora_id_reused"
    assert voided == [1]  # requests keyed with id 1 before store nothing more
    again = keys.salt(request(lora_request(one, "a", 1)))
    assert isinstance(again, Uncacheable) and again.reason == "lora_id_reused"
    assert isinstance(keys.salt(request(lora_request(two, "b", 2))), str)  # its own id: fine


def test_an_adapter_reloaded_in_place_is_not_cached(tmp_path: Path) -> None:
    keys = RequestKeys(None)
    voided: list[int] = []
    keys.on_adapter_void = voided.append
    folder = adapter(tmp_path / "a", b"\x01" * 64)
    assert isinstance(keys.salt(request(lora_request(folder, "a", 3))), str)
    reload = lora_request(folder, "a", 3)
    reload.load_inplace = True
    verdict = keys.salt(request(reload))
    assert isinstance(verdict, Uncacheable) and verdict.reason == "lora_reloaded"
    assert voided == [3]
    assert isinstance(keys.salt(request(lora_request(folder, "a", 3))), Uncacheable)


def test_a_large_adapter_is_digested_off_the_scheduler_s_thread(tmp_path: Path) -> None:
    import time

    from kvpersist.identity.weights_digest import FileDigestCache

    folder = adapter(tmp_path / "big", b"\x05" * 4096)
    keys = RequestKeys(None, digests=FileDigestCache(tmp_path / "digests"), inline_bytes=1024)
    first = keys.salt(request(lora_request(folder)))
    assert isinstance(first, Uncacheable) and first.reason == "lora_digest_pending"
    deadline = time.monotonic() + 30
    while isinstance(salt := keys.salt(request(lora_request(folder))), Uncacheable):
        assert salt.reason == "lora_digest_pending" and time.monotonic() < deadline
        time.sleep(0.01)
    # the same key an inline digest gives
    assert salt == RequestKeys(None, inline_bytes=1 << 30).salt(request(lora_request(folder)))
    # a restart (a new engine) finds every file's digest cached: keyed at once, nothing read
    restarted = RequestKeys(None, digests=FileDigestCache(tmp_path / "digests"),
                            inline_bytes=1024)
    assert restarted.salt(request(lora_request(folder))) == salt


def test_images_of_a_model_that_attends_bidirectionally_over_them_are_not_cached() -> None:
    import torch

    verdict = RequestKeys(None, mm_bidirectional=True).salt(
        image_request(torch.zeros(2, 2), "x"))
    assert isinstance(verdict, Uncacheable) and verdict.reason == "mm_bidirectional"
    assert RequestKeys(None, mm_bidirectional=True).salt(request()) == ""  # text: cached


def test_lmcache_s_token_keys_carry_the_image_s_content_not_its_label() -> None:
    """kvpersist writes each item's content digest over its placeholder tokens in LMCache's
    real tracker: two images under one label get other token keys, one image under two labels
    (a counter before and after a restart) the same ones, so it is found after a restart."""
    import torch
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestTracker

    from kvpersist.serving.connector.request_keys import RequestKey
    from kvpersist.serving.lmcache_compat.adapters import key_items_by_content

    keys = RequestKeys(None)

    def token_keys(pixels: torch.Tensor, label: str) -> list[int]:
        req = image_request(pixels, label)
        key = keys.key(req)
        assert isinstance(key, RequestKey) and key.item_digests is not None
        tracker = LMCacheMPRequestTracker(req)
        key_items_by_content(tracker, req, key.item_digests)
        return list(tracker.get_token_ids())

    image_a = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    image_b = image_a.flip(0)
    assert token_keys(image_a, "renderer0-mm-1-image-0") != token_keys(
        image_b, "renderer0-mm-1-image-0")
    assert token_keys(image_a, "renderer0-mm-1-image-0") == token_keys(
        image_a.clone(), "renderer0-mm-7-image-0")
    keyed = token_keys(image_a, "x")
    assert keyed[:4] == [1, 2, 3, 4] and keyed[12:14] == [5, 6] and keyed[4:12] != [9] * 8
