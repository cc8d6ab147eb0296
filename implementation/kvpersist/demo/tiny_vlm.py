"""Build a tiny random-weight Idefics3 vision-language model, with no downloads.

It is the multimodal sibling of :mod:`kvpersist.demo.tiny_model`: same cache layout, same
content-address revision, same "random weights, deterministic bytes" rule.  The architecture
is ``Idefics3ForConditionalGeneration`` (a SigLIP-style vision tower, a pixel-shuffle
connector, a Llama text tower), which vLLM serves natively (multimodal processor, encoder
cache, multimodal prefix-cache keys) on CPU.

Why not Qwen2-VL: the CPU stack pinned in ``requirements/cpu-lock.txt`` has no torchvision,
and vLLM's ``qwen2_vl``/``qwen2_5_vl``/``qwen3_vl`` (as well as ``llava``, ``gemma3_mm``,
``pixtral``, ``mistral3``) modules import transformers' torchvision-only image processors at
import time, so vLLM cannot even inspect those architectures here.  ``idefics3`` imports
cleanly and its processor has a PIL backend (transformers picks ``Idefics3ImageProcessorPil``
when torchvision is missing) and no video processor.

Invariants
----------
* The model is written in the Hugging Face cache layout
  ``<out>/models--kvpersist--tiny-idefics3/snapshots/<revision>/``, where ``<revision>`` is
  :func:`kvpersist.demo.tiny_model.content_revision` of the snapshot (sha1 over the sorted
  file names and bytes).  Building twice with the same pinned torch/transformers gives the
  same bytes and so the same revision.
* Every file is written by this module from fixed inputs (a fixed seed for the weights,
  JSON with sorted keys for the processor files); nothing is read from the hub.
* The tokenizer is byte-level (one token per UTF-8 byte) after the special tokens of
  :data:`SPECIAL_TOKENS`, which hold ids 0..42 in that order; ``config.json``'s
  ``image_token_id`` is the id of ``<image>``.
* Text tower: head_dim 32 (vLLM's CPU attention needs >= 32), 1 KiB of float32 KV per token,
  like tiny-llama.  Vision tower: 64x64-pixel input, 8x8-pixel patches, pixel-shuffle scale 2,
  so one image is :data:`IMAGE_TOKENS` = (64 / 8)**2 / 2**2 = 16 ``<image>`` tokens.
* The image processor does no splitting: every image, whatever its size, is resized to one
  64x64 tile, so it is always exactly :data:`IMAGE_TOKENS` ``<image>`` tokens, and the processor
  expands a chat's one ``<image>`` into :data:`IMAGE_PROMPT_TOKENS` = 19 tokens:
  ``<fake_token_around_image><global-img>`` + 16 x ``<image>`` + ``<fake_token_around_image>``.
* The chat template is ChatML (Qwen-style ``<|im_start|>role\\n...<|im_end|>\\n``, no default
  system prompt).  A string content renders as it is; in an OpenAI-style content list, a part
  of type ``image`` or ``image_url`` renders as ``<image>`` and a ``text`` part as its text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .tiny_model import byte_level_tokenizer, publish_snapshot

MODEL_ID = "kvpersist/tiny-idefics3"
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
#: Special tokens, in id order; the byte alphabet follows them.  The processor looks up every
#: one of these by name (the row/col tags only when image splitting is turned on).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    FAKE_IMAGE_TOKEN,
    IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
TOKEN_IDS = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text tower (Llama): head_dim = HIDDEN // HEADS = 32.
HIDDEN, LAYERS, HEADS, KV_HEADS, MAX_POS = 128, 2, 4, 2, 2048
# Vision tower: one block, 64 wide, 2 heads of 32; 64x64 images in 8x8 patches.
VISION_HIDDEN, VISION_LAYERS, VISION_HEADS = 64, 1, 2
IMAGE_SIZE, PATCH, SCALE_FACTOR = 64, 8, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE_FACTOR**2
#: What one image becomes in the prompt: the tokens around it plus its ``<image>`` tokens.
IMAGE_PROMPT_TOKENS = IMAGE_TOKENS + 3
SEED = 20261130


def _dump_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(folder: Path) -> int:
    tok, vocab_size = byte_level_tokenizer(dict(TOKEN_IDS), SPECIAL_TOKENS,
                                           eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                           model_max_length=MAX_POS)
    tok.save_pretrained(str(folder))
    # The template lives in chat_template.jinja only (one source): the processor reads it from
    # there (not from tokenizer_config.json), and so does the tokenizer.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    _dump_json(cfg_path, cfg)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return vocab_size


def _write_processor(folder: Path) -> None:
    """The processor's configs, in the hub's Idefics3 format (hand-written, sorted keys)."""
    _dump_json(folder / "processor_config.json", {
        "image_seq_len": IMAGE_TOKENS,
        "processor_class": "Idefics3Processor",
    })
    _dump_json(folder / "preprocessor_config.json", {
        "do_convert_rgb": True,
        "do_image_splitting": False,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Idefics3ImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "processor_class": "Idefics3Processor",
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": IMAGE_SIZE},
    })


def _write_model(folder: Path, vocab_size: int) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HIDDEN // HEADS,
            "max_position_embeddings": MAX_POS,
            "rms_norm_eps": 1e-5,
            "bos_token_id": TOKEN_IDS["<|im_start|>"],
            "eos_token_id": TOKEN_IDS["<|im_end|>"],
            "pad_token_id": TOKEN_IDS["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": VISION_HIDDEN,
            "intermediate_size": 2 * VISION_HIDDEN,
            "num_hidden_layers": VISION_LAYERS,
            "num_attention_heads": VISION_HEADS,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
        },
        scale_factor=SCALE_FACTOR,
        image_token_id=TOKEN_IDS[IMAGE_TOKEN],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    model.to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)


def build_tiny_vlm(out_dir: str | Path) -> Path:
    """Build (or reuse) the tiny Idefics3 model under ``out_dir``; return its snapshot folder."""
    def write(folder: Path) -> None:
        vocab_size = _write_tokenizer(folder)
        _write_processor(folder)
        _write_model(folder, vocab_size)

    return publish_snapshot(out_dir, MODEL_ID, write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.demo.tiny_vlm",
        description="Build the tiny random-weight Idefics3 vision-language model (byte tokenizer, "
        "ChatML chat template, 16 tokens per image) in HF cache layout and print its snapshot "
        "folder. No network access is used.",
    )
    parser.add_argument("out_dir", help="folder to build into (the HF-cache-style root)")
    args = parser.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(build_tiny_vlm(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
