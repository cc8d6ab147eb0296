"""Build the tiny Llama-architecture model used by the CPU demo and the tests, with no downloads.

Invariants
----------
* The model is written in the Hugging Face cache layout
  ``<out>/models--kvpersist--tiny-llama/snapshots/<revision>/``, where ``<revision>`` is the
  sha1 over the sorted file names and bytes of the snapshot (a content address, 40 hex
  digits like a hub commit SHA).  Building twice with the same pinned torch/transformers
  gives the same bytes and so the same revision; ``configs/tiny-llama/identity.env`` pins it.
* The tokenizer is byte-level (one token per UTF-8 byte, plus the chat special tokens), so a
  prompt of N ASCII characters is about N tokens.
* head_dim is 32 (vLLM's CPU attention needs ≥ 32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

MODEL_ID = "kvpersist/tiny-llama"
#: The pins of the model this module builds (package data; ``configs/tiny-llama`` links here).
TINY_PINS = Path(__file__).resolve().parent / "tiny-llama" / "identity.env"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 128, 2, 4, 2, 32, 2048


class Geometry(NamedTuple):
    """The shape of a generated model; its KV per token is what a restore moves."""

    model_id: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_pos: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, float32."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


#: The demo's model: 1 KiB of KV per token.
TINY = Geometry(MODEL_ID, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MAX_POS)
#: The demo's model with a 40k-token context: long conversations at 1 KiB of KV per token.
LONG_CONTEXT = Geometry("kvpersist/tiny-llama-long", HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, 40960)
#: Cheap to compute, 64 KiB of KV per token (a 2k-token chat is 128 MiB): for restore tests.
WIDE_KV = Geometry("kvpersist/tiny-llama-wide-kv", 512, 16, 8, 8, 64, 4096)
#: The traffic runs' model: chats up to 64k tokens, 4 KiB of KV per token (1 MiB per chunk) on
#: two cheap layers, so a 2-core host serves many users and the tier still moves real bytes.
TRAFFIC = Geometry("kvpersist/tiny-llama-traffic", HIDDEN, LAYERS, HEADS, 4, 64, 66560)


def content_revision(folder: Path) -> str:
    """sha1 over (relative name, size, bytes) of every file under ``folder``, sorted by name."""
    digest = hashlib.sha1()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix().encode()
        digest.update(len(rel).to_bytes(8, "little") + rel)
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def byte_level_tokenizer(specials: dict[str, int], added: list[str], **named: Any
                         ) -> tuple[Any, int]:
    """A byte-level BPE tokenizer without merges, and its vocabulary size: ``specials`` (token
    -> id) first, then the 256 byte symbols; ``added`` become special tokens, ``named`` the
    tokenizer's named ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(specials)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(added)
    return PreTrainedTokenizerFast(tokenizer_object=core, **named), len(vocab)


def _write_tokenizer(folder: Path, max_pos: int) -> int:
    specials = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    tok, vocab_size = byte_level_tokenizer(specials, SPECIAL_TOKENS, bos_token="<|bos|>",
                                           eos_token="<|eos|>", pad_token="<|pad|>",
                                           model_max_length=max_pos)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    # Keep the template in tokenizer_config.json (one source), not a separate jinja file.
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = jinja.read_text()
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        jinja.unlink()
    return vocab_size


def _write_model(folder: Path, vocab_size: int, geometry: Geometry) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=geometry.hidden,
        intermediate_size=4 * geometry.hidden,
        num_hidden_layers=geometry.layers,
        num_attention_heads=geometry.heads,
        num_key_value_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
        max_position_embeddings=geometry.max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(20261129)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    model.to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)


def publish_snapshot(out_dir: str | Path, model_id: str, write: Callable[[Path], None]) -> Path:
    """Have ``write(folder)`` write a model's files, then publish them as the Hugging Face cache
    snapshot ``<out_dir>/models--<org>--<name>/snapshots/<content sha1>`` (an existing snapshot
    of the same content is kept as it is); return the snapshot folder."""
    out = Path(out_dir)
    repo_dir = out / ("models--" + model_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    with tempfile.TemporaryDirectory(dir=out if out.exists() else None) as tmp:
        staging = Path(tmp) / "snapshot"
        staging.mkdir()
        write(staging)
        revision = content_revision(staging)
        final = snapshots / revision
        if not final.is_dir():
            snapshots.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging), str(final))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return final


def build_tiny_model(out_dir: str | Path, geometry: Geometry = TINY) -> Path:
    """Build (or reuse) the model of ``geometry`` under ``out_dir``; return its snapshot folder."""
    def write(folder: Path) -> None:
        _write_model(folder, _write_tokenizer(folder, geometry.max_pos), geometry)

    return publish_snapshot(out_dir, geometry.model_id, write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.demo.tiny_model",
        description="Build the tiny random-weight Llama model (byte tokenizer, chat template) "
        "in HF cache layout and print its snapshot folder. No network access is used.",
    )
    parser.add_argument("out_dir", help="folder to build into (the HF-cache-style root)")
    parser.add_argument("--wide-kv", action="store_true",
                        help="the restore tests' geometry (16 layers x 8 KV heads x 64: 64 KiB of "
                        "KV per token) instead of the demo's (1 KiB per token)")
    args = parser.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(build_tiny_model(args.out_dir, WIDE_KV if args.wide_kv else TINY))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
