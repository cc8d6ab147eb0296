"""Multimodal keys with vLLM's real front end, in process: an image's label repeats, its key not.

vLLM names every multimodal item with an ``identifier`` and LMCache's tracker
(``LMCacheMPRequestTracker.get_token_ids``) writes values derived from that identifier over the
item's placeholder tokens.  The identifier is a label, not the content: with prefix caching off
and ``mm_processor_cache_gb=0`` it is the renderer's per-process counter
(``renderer0-mm-1-image-0``, counted again from 1 after every restart), and a client-supplied
``uuid`` is taken verbatim.  So two different images can reach LMCache under the same label, and
then with the same token ids.

These tests build requests the way a served engine does, with no engine: the tiny Idefics3
model (:mod:`kvpersist.demo.tiny_vlm`), vLLM's real renderer (``render_chat`` of an OpenAI
message whose ``image_url`` part is a PNG data URL, with the part's ``uuid`` when the client
sends one), vLLM's real ``InputProcessor.process_inputs`` (the ``EngineCoreRequest``), the
msgpack hop to the engine core, ``EngineCore.preprocess_add_request``'s steps (the receiver
cache, none with the processor cache off, then ``Request.from_engine_core_request``), and
LMCache's real tracker on the scheduler's ``Request``.  A restart is a fresh renderer and
input processor.  They show:

* the hazard: image A in one process and image B in a fresh one get the same counter label,
  and one client uuid sent with two images is the label of both, while the images' pixels
  differ; LMCache's tracker token ids are then equal;
* kvpersist's salt (``RequestKeys(None).salt``, a digest of each item's processed input
  tensors) differs for them, so it alone keeps their KV apart; the same image under two labels
  (two counters, two uuids, a counter and a uuid) keeps one salt.

Negative control: with the content digest taken out of the salt, i.e.
``request_salt(user_salt, None)`` only (what the salt was before kvpersist keyed items by
content), the two images' keys, tracker token ids and salt, would be equal: each test asserts
that too, so the difference in the salt comes from the content digest and nothing else.
"""

from __future__ import annotations

import base64
import io
import re
from typing import TYPE_CHECKING, Any

import pytest

from kvpersist.demo.tiny_vlm import IMAGE_PROMPT_TOKENS, build_tiny_vlm
from kvpersist.serving.connector.request_keys import (
    MM_TAG,
    RESERVED_PREFIX,
    RequestKeys,
    request_salt,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

pytestmark = pytest.mark.integration

RED = (220, 30, 30)
BLUE = (30, 30, 220)
#: vLLM's label for a request's first image when it hashes nothing (``BaseRenderer``).
COUNTER_LABEL = re.compile(r"renderer\d+-mm-\d+-image-0")


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    """The tiny VLM's engine config with prefix caching and the processor cache off, the
    settings under which vLLM labels items by a counter (built once per module)."""
    from vllm.engine.arg_utils import EngineArgs

    folder = build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    config = EngineArgs(model=str(folder), max_model_len=2048, dtype="float32",
                        enable_prefix_caching=False,
                        mm_processor_cache_gb=0).create_engine_config()
    assert not config.cache_config.enable_prefix_caching
    assert config.model_config.multimodal_config is not None
    assert config.model_config.multimodal_config.mm_processor_cache_gb == 0
    return config


def data_url(color: tuple[int, int, int]) -> str:
    """A 64x64 one-colour PNG as an OpenAI ``image_url`` data URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class ServingProcess:
    """One vLLM process's front end (``AsyncLLM`` holds one renderer and one input processor)
    and its engine core's receiving side; a new instance is what a restart gives."""

    def __init__(self, config: VllmConfig) -> None:
        from vllm.multimodal.cache.factories import engine_receiver_cache_from_config
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.renderer = renderer_from_config(config)
        self.processor = InputProcessor(config, self.renderer)
        self.receiver_cache = engine_receiver_cache_from_config(config)
        self._count = 0

    def request(self, color: tuple[int, int, int], uuid: str | None = None) -> Request:
        """The scheduler's ``Request`` for a chat message with one image of ``color`` (and
        the client's ``uuid`` for it, if any) and the same text."""
        from vllm.renderers.params import ChatParams
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.request import Request
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(color)}}
        if uuid is not None:
            part["uuid"] = uuid
        messages: list[Any] = [{"role": "user", "content": [
            part, {"type": "text", "text": "What colour is this image?"}]}]
        (_conversation,), (engine_input,) = self.renderer.render_chat([messages],
                                                                      ChatParams())
        self._count += 1
        core_request = self.processor.process_inputs(
            f"req-{self._count}", engine_input, SamplingParams(max_tokens=8),
            supported_tasks=("generate",))
        # the front end -> engine core hop (ZMQ in a served engine): msgpack both ways
        received = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(core_request))
        # EngineCore.preprocess_add_request
        if self.receiver_cache is not None and received.mm_features:
            received.mm_features = self.receiver_cache.get_and_update_features(
                received.mm_features)
        return Request.from_engine_core_request(received, None)


def the_image(request: Request) -> Any:
    """The request's one multimodal feature (``MultiModalFeatureSpec``)."""
    assert request.mm_features is not None and len(request.mm_features) == 1
    feature = request.mm_features[0]
    assert feature.modality == "image" and feature.mm_position.length == IMAGE_PROMPT_TOKENS
    assert feature.data is not None  # the processor cache is off: the inputs travel along
    return feature


def pixels(request: Request) -> Any:
    """The processed pixel values the engine computes the image's KV from."""
    return the_image(request).data["pixel_values"].data


def tracker_token_ids(request: Request) -> list[int]:
    """The token ids LMCache keys the request's chunks by (placeholders replaced from the
    identifier)."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestTracker

    return LMCacheMPRequestTracker(request).get_token_ids()


def kvpersist_salt(request: Request) -> str:
    """The salt kvpersist gives the request's tracker."""
    salt = RequestKeys(None).salt(request)
    assert isinstance(salt, str), salt
    assert salt.startswith(f"{RESERVED_PREFIX}{MM_TAG}-")
    return salt


def assert_only_the_salt_separates(one: Request, two: Request) -> None:
    """``one`` and ``two`` (different images, one label) look alike to LMCache; kvpersist's
    salt alone differs, and without the content digest it would not."""
    import torch

    assert not torch.equal(pixels(one), pixels(two))  # different images reach the engine
    assert one.prompt_token_ids == two.prompt_token_ids
    assert tracker_token_ids(one) == tracker_token_ids(two)  # LMCache's part of the key
    assert kvpersist_salt(one) != kvpersist_salt(two)
    # negative control: the salt without the content digest is equal, so is the whole key
    assert request_salt(one.cache_salt or "", None) == request_salt(two.cache_salt or "", None)


def test_a_restart_repeats_vllm_s_counter_label_for_another_image(
        vllm_config: VllmConfig) -> None:
    image_a = ServingProcess(vllm_config).request(RED)
    image_b = ServingProcess(vllm_config).request(BLUE)  # after a restart: counted from 1
    label = the_image(image_a).identifier
    assert COUNTER_LABEL.fullmatch(label), label
    assert the_image(image_b).identifier == label  # the hazard: one label, two images
    assert_only_the_salt_separates(image_a, image_b)


def test_a_client_uuid_reused_for_another_image_is_its_label_too(
        vllm_config: VllmConfig) -> None:
    process = ServingProcess(vllm_config)
    image_a = process.request(RED, uuid="product-photo")
    image_b = process.request(BLUE, uuid="product-photo")
    assert the_image(image_a).identifier == the_image(image_b).identifier == "product-photo"
    assert_only_the_salt_separates(image_a, image_b)


def test_the_same_image_under_other_labels_keeps_its_salt(vllm_config: VllmConfig) -> None:
    import torch

    process = ServingProcess(vllm_config)
    first, second = process.request(RED), process.request(RED)  # counter 1, counter 2
    by_uuid = [process.request(RED, uuid=u) for u in ("photo-1", "photo-2")]
    after_restart = ServingProcess(vllm_config).request(RED)
    same = [first, second, *by_uuid, after_restart]
    labels = [the_image(r).identifier for r in same]
    assert len(set(labels[:4])) == 4 and labels[4] == labels[0]
    assert all(torch.equal(pixels(r), pixels(first)) for r in same)
    assert {kvpersist_salt(r) for r in same} == {kvpersist_salt(first)}
    # LMCache's token ids follow the label: the same image under another label is a miss
    # there, whatever the salt; under the same label (a restart) they are equal
    assert tracker_token_ids(first) != tracker_token_ids(second)
    assert tracker_token_ids(by_uuid[0]) != tracker_token_ids(by_uuid[1])
    assert tracker_token_ids(after_restart) == tracker_token_ids(first)
