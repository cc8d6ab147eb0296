"""The vLLM flags that enter the cache identity, read as vLLM reads them (one definition for
``kvp-admin identity``, the pins writer and the launcher).

Invariants
----------
* :func:`add_engine_flags` spells each flag as vLLM does; :func:`identity_flags` reads them out
  of a recipe's argument list (other flags ignored), a flag the recipe leaves out that vLLM
  defaults (:data:`VLLM_DEFAULTS`, held to the installed vLLM by a test) taking vLLM's default.
* A malformed value raises :class:`EngineFlagsError`, never SystemExit.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from .engine_fields import DRAFT_FREE_METHODS

#: vLLM's own defaults (``EngineArgs``) for the identity flags a recipe may leave out; a test
#: holds them to the installed vLLM.  Block size and max model length have none: vLLM derives
#: them from the platform and the model, so a recipe must say them (or ``--set``).
VLLM_DEFAULTS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}

class EngineFlagsError(ValueError):
    """The identity flags of a vLLM argument list cannot be read; the message says which."""

@dataclass(frozen=True)
class IdentityFlags:
    """The identity-relevant flags of a vLLM argument list (None: not given)."""

    model: str | None = None
    block_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    chat_template: str | None = None
    quantization: str | None = None
    hf_overrides: str | None = None  # JSON text, as vLLM takes it
    mm_processor_kwargs: str | None = None  # JSON text, as vLLM takes it
    speculative_config: str | None = None  # JSON text, as vLLM takes it

def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The identity-relevant vLLM flags, spelled as vLLM spells them: read out of a recipe's
    arguments (:func:`identity_flags`) and offered by ``kvp-admin identity`` (one definition)."""
    p.add_argument("--block-size", type=int, help="vLLM --block-size")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, help="vLLM -tp")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, help="vLLM -pp")
    p.add_argument("--max-model-len", type=int, help="vLLM --max-model-len")
    p.add_argument("--dtype", help="vLLM --dtype (decides an 'auto' KV-cache dtype)")
    p.add_argument("--kv-cache-dtype",
                   help="vLLM --kv-cache-dtype; 'auto' resolves to the weights' dtype")
    p.add_argument("--chat-template", help="vLLM --chat-template (a file)")
    p.add_argument("--quantization", "-q",
                   help="vLLM --quantization (else the checkpoint's quantization_config decides)")
    p.add_argument("--hf-overrides", help="vLLM --hf-overrides (JSON: rope scaling and the like)")
    p.add_argument("--mm-processor-kwargs",
                   help="vLLM --mm-processor-kwargs (JSON: the multimodal processor's settings)")
    p.add_argument("--speculative-config",
                   help="vLLM --speculative-config (JSON); a draft model's digest "
                        "(draft_sha256) is the engine's to compute")


def _flag_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--model")
    add_engine_flags(p)
    return p

def identity_flags(args: str | Sequence[str]) -> IdentityFlags:
    """Parse the identity-relevant flags out of vLLM arguments (a string is split like a shell
    would); other flags are ignored, and a flag the recipe leaves out that vLLM defaults
    (:data:`VLLM_DEFAULTS`) takes vLLM's default, as the engine would.  A malformed value
    raises :class:`EngineFlagsError`."""
    argv = shlex.split(args) if isinstance(args, str) else list(args)
    # `vllm serve MODEL ...` / `kvp-vllm MODEL ...`: a leading positional is the model
    model = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        known, _ = _flag_parser().parse_known_args(argv[1:] if model else argv)
    except (argparse.ArgumentError, SystemExit) as exc:  # a bad int; never exit the caller
        raise EngineFlagsError(f"cannot read the identity flags of the vLLM arguments {argv!r}"
                               f" ({exc}); check --block-size, -tp, -pp and --max-model-len"
                               ) from None
    return IdentityFlags(model=known.model or model, block_size=known.block_size,
                         tensor_parallel_size=_or_default(known, "tensor_parallel_size"),
                         pipeline_parallel_size=_or_default(known, "pipeline_parallel_size"),
                         max_model_len=known.max_model_len, dtype=known.dtype,
                         kv_cache_dtype=known.kv_cache_dtype, chat_template=known.chat_template,
                         quantization=known.quantization, hf_overrides=known.hf_overrides,
                         mm_processor_kwargs=known.mm_processor_kwargs,
                         speculative_config=known.speculative_config)

def _json_object(flag: str, text: str | None) -> dict[str, object] | None:
    """A JSON-object flag as the mapping vLLM takes; EngineFlagsError when it is not one."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineFlagsError(f"{flag} {text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise EngineFlagsError(f"{flag} {text!r} must be a JSON object")
    return value


def names_a_draft(flags: IdentityFlags) -> bool:
    """Whether the recipe's ``--speculative-config`` runs a draft model (anything but the
    draft-free proposers); EngineFlagsError when it is not a JSON object."""
    spec = _json_object("--speculative-config", flags.speculative_config)
    if spec is None:
        return False
    return spec.get("method") not in DRAFT_FREE_METHODS or spec.get("model") is not None


def hf_overrides_of(flags: IdentityFlags) -> dict[str, object] | None:
    """``--hf-overrides`` as the mapping vLLM applies; EngineFlagsError when it is not a JSON object."""
    return _json_object("--hf-overrides", flags.hf_overrides)


def mm_processor_kwargs_of(flags: IdentityFlags) -> dict[str, object] | None:
    """``--mm-processor-kwargs`` as the mapping vLLM applies; EngineFlagsError when it is not a
    JSON object."""
    return _json_object("--mm-processor-kwargs", flags.mm_processor_kwargs)

def _or_default(known: argparse.Namespace, name: str) -> int:
    value = getattr(known, name)
    return VLLM_DEFAULTS[name] if value is None else int(value)
