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
