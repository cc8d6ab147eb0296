"""An image is keyed by its content, never by vLLM's label for it, across a restart of vLLM.

Real processes: the LMCache MP server with kvpersist's L2, and vLLM (CPU) serving a tiny
random-weights vision-language model built here (``kvpersist.demo.tiny_vlm``, Idefics3) through
``kvp-vllm``, with vLLM's prefix cache off and its multimodal processor cache at 0: vLLM then
labels each image with a per-process counter (``renderer0-mm-1-image-0``), the same label for
the first image after every start.  Image A's chat is stored; vLLM restarts; image B under the
same text is computed cold (no chunk from A's KV), then A comes back from L2 bit-identical.
The probe can fail: A's and B's cold answers differ.  Without kvpersist's content digest in the
salt, B would be served A's KV (same label, same token IDs).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.helpers import pins_for_model, wait_for_l2_files

pytestmark = pytest.mark.e2e
CHUNK = 256
TEXT = " ".join(f"Describe picture detail number {i} and what it may mean." for i in range(14))


def image_url(color: tuple[int, int, int]) -> str:
    from PIL import Image

    picture = Image.new("RGB", (64, 64), color)
    for x in range(0, 64, 8):  # a pattern, so the two images differ in more than their mean
        picture.putpixel((x, x), (255 - color[0], 255 - color[1], 255 - color[2]))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(color: tuple[int, int, int]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url(color)}},
        {"type": "text", "text": TEXT}]}]


def vlm_engine(model: Path, pins: Path, log: Path, server_env: dict[str, str]) -> VllmProcess:
    return VllmProcess(model, pins, log, server_env, extra_args=[
        "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
        "--limit-mm-per-prompt", '{"image": 1}'])


def test_an_image_is_keyed_by_its_content_across_a_restart(
        tmp_path: Path, server_env: dict[str, str], settings: ServerSettings) -> None:
    from kvpersist.demo.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "models")
    pins = pins_for_model(model, tmp_path / "identity.env")
    image_a, image_b = messages((200, 30, 30)), messages((30, 30, 200))
    full = lambda tokens: tokens // CHUNK * CHUNK  # noqa: E731

    start_server(settings)
    vllm = vlm_engine(model, pins, tmp_path / "vllm-1.log", server_env)
    try:
        vllm.start()
        cold_a = chat(vllm.base_url, image_a)  # type: ignore[arg-type]
        assert cold_a.cached_tokens == 0 and cold_a.prompt_tokens >= 2 * CHUNK, cold_a
        wait_for_l2_files(settings.cache_root, cold_a.prompt_tokens // CHUNK)
    finally:
        vllm.kill()

    # vLLM restarted: its counter labels image B as it labelled image A
    vllm = vlm_engine(model, pins, tmp_path / "vllm-2.log", server_env)
    try:
        vllm.start()
        cold_b = chat(vllm.base_url, image_b)  # type: ignore[arg-type]
        assert cold_b.cached_tokens == 0, cold_b  # never A's KV
        assert cold_b.prompt_tokens == cold_a.prompt_tokens
        # the probe can fail: the two images give different answers
        assert cold_b.logprobs != cold_a.logprobs
        again_a = chat(vllm.base_url, image_a)  # type: ignore[arg-type]
        assert again_a.cached_tokens == full(cold_a.prompt_tokens - 1), again_a
        assert (again_a.tokens, again_a.logprobs) == (cold_a.tokens, cold_a.logprobs)
    finally:
        vllm.kill()
