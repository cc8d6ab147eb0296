"""Compatibility identity: its fields, the namespace they hash to, and how two sources merge.

Invariants
----------
* Every field of :class:`CacheIdentity` is required and validated; an identity object that
  exists is complete.  There is no "unknown" value: an unknown field means no identity,
  and no identity means caching is off (``IdentityResolution.enabled is False``).
* The namespace is a pure function of the field values: ``kvp-`` + the first 32 hex digits
  of sha256 over the canonical JSON (``sort_keys=True``, ``separators=(",", ":")``, ASCII).
  Input order and formatting (``"16"`` vs ``16``, ``torch.float16`` vs ``float16``, letter
  case of hex digests) never change it; any change of a value always does.
* ``lmcache_model_name()`` is ``<model id>/<namespace>``; LMCache uses it as the model name of
  every object key, so every L2 file name carries the sanitized model id and the namespace.
* A wrong hit is never acceptable, a miss always is: when two sources (pins and the live
  engine) disagree on a field, the result is *off*, never one of the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_PREFIX = "kvp-"
#: A namespace anywhere in a text (a log line, a model name, a JSON document).
NAMESPACE_IN_TEXT = re.compile(r"kvp-[0-9a-f]{32}")
NAMESPACE_RE = re.compile(rf"^{NAMESPACE_IN_TEXT.pattern}$")
_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
#: Pinned in place of a chat template digest when the model has no chat template at all.
NO_CHAT_TEMPLATE = "none"
#: ``mm_processor_kwargs_sha256`` of an engine without engine-level processor kwargs.
NO_MM_PROCESSOR_KWARGS = "none"
#: ``draft_sha256`` of an engine without a draft model (no speculative decoding, or n-grams).
NO_DRAFT = "none"

#: Canonical KV-cache dtype names.  ``auto`` is deliberately absent: it is not a dtype.
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
    "fp8_inc": "fp8_inc", "fp8_ds_mla": "fp8_ds_mla",
    "int8": "int8", "uint8": "uint8",
}


class IdentityError(ValueError):
    """A field is missing, empty, malformed or contradicted.  ``field`` names it."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"identity field '{field_name}': {reason}")
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True)
class FieldSpec:
    """How one identity field is named in pins files and how its values are normalized."""

    name: str
    env: str
    kind: str  # "text" | "sha1" | "sha256" | "dtype" | "posint"
    doc: str


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("model_id", "KVP_MODEL_ID", "text", "model id, e.g. org/name (no '@')"),
    FieldSpec("model_revision", "KVP_MODEL_REVISION", "sha1", "full 40-hex commit SHA of the weights"),
    FieldSpec("tokenizer_id", "KVP_TOKENIZER_ID", "text", "tokenizer id"),
    FieldSpec("tokenizer_revision", "KVP_TOKENIZER_REVISION", "sha1", "full 40-hex tokenizer commit SHA"),
    FieldSpec("kv_cache_dtype", "KVP_KV_CACHE_DTYPE", "dtype", "resolved KV-cache dtype ('auto' refused)"),
    FieldSpec("block_size", "KVP_BLOCK_SIZE", "posint", "vLLM KV block size in tokens"),
    FieldSpec("num_kv_heads", "KVP_NUM_KV_HEADS", "posint", "total number of KV heads"),
    FieldSpec("head_size", "KVP_HEAD_SIZE", "posint", "head dimension"),
    FieldSpec("num_layers", "KVP_NUM_LAYERS", "posint", "number of attention layers (stricter; extra)"),
    FieldSpec("tensor_parallel_size", "KVP_TP_SIZE", "posint", "tensor-parallel size"),
    FieldSpec("pipeline_parallel_size", "KVP_PP_SIZE", "posint", "pipeline-parallel size (stricter; extra)"),
    FieldSpec("connector", "KVP_CONNECTOR", "text", "KV connector class name"),
    FieldSpec("build", "KVP_BUILD", "text", "exact build identity of connector, LMCache and vLLM"),
    FieldSpec("max_model_len", "KVP_MAX_MODEL_LEN", "posint", "max model length in tokens"),
    FieldSpec("chat_template_sha256", "KVP_CHAT_TEMPLATE_SHA256", "sha256",
              "sha256 of the chat template vLLM uses, or 'none'"),
    FieldSpec("model_dtype", "KVP_MODEL_DTYPE", "dtype",
              "the model's compute dtype as vLLM resolves --dtype ('auto' refused)"),
    FieldSpec("quantization", "KVP_QUANTIZATION", "text",
              "weight quantization method as vLLM resolves it, or 'none'"),
    FieldSpec("model_config_sha256", "KVP_MODEL_CONFIG_SHA256", "sha256",
              "sha256 of the checkpoint's config.json with --hf-overrides (rope scaling, "
              "quantization_config, architecture)"),
    FieldSpec("weights_sha256", "KVP_WEIGHTS_SHA256", "sha256",
              "sha256 over the model folder's files by their bytes (weights, config, tokenizer; "
              "kvpersist.identity.weights_digest)"),
    FieldSpec("mm_processor_kwargs_sha256", "KVP_MM_PROCESSOR_KWARGS_SHA256", "sha256",
              "sha256 of the engine-level --mm-processor-kwargs as canonical JSON, or 'none' "
              "when there are none"),
    FieldSpec("draft_sha256", "KVP_DRAFT_SHA256", "sha256",
              "sha256 of a speculative draft model as the engine resolves it (method, the "
              "draft folder's bytes and config, dtype, quantization, TP; "
              "kvpersist.identity.draft), or 'none' without one; the engine computes it"),
)
#: Fields added after namespaces were in use, with the value every earlier identity had.  At
#: that value a field is left out of the canonical JSON and of records (so no namespace that
#: existed before it changes) and filled in when a record lacks it; any other value is in both.
OPTIONAL_FIELDS: dict[str, str] = {"mm_processor_kwargs_sha256": NO_MM_PROCESSOR_KWARGS,
                                    "draft_sha256": NO_DRAFT}
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
_BY_NAME: dict[str, FieldSpec] = {f.name: f for f in FIELDS}
BY_ENV: dict[str, FieldSpec] = {f.env: f for f in FIELDS}


def normalize_field(name: str, value: object) -> str | int:
    """Return the canonical form of one field value, or raise :class:`IdentityError`.

    Canonical forms: stripped text; lower-case hex digests; canonical dtype names; ints.
    """
    spec = _BY_NAME.get(name)
    if spec is None:
        raise IdentityError(name, "is not an identity field")
    if value is None:
        raise IdentityError(name, "is missing")
    if isinstance(value, bool):
        raise IdentityError(name, f"must not be a boolean, got {value!r}")
    text = str(value).strip()
    if not text:
        raise IdentityError(name, "is empty")
    if spec.kind == "posint":
        try:
            number = int(text, 10)
        except ValueError:
            raise IdentityError(name, f"must be a positive integer, got {text!r}") from None
        if number <= 0:
            raise IdentityError(name, f"must be a positive integer, got {number}")
        return number
    if spec.kind == "sha1":
        low = text.lower()
        if not _SHA1_RE.match(low):
            raise IdentityError(
                name, f"must be a full 40-hex commit SHA (not a branch or tag), got {text!r}"
            )
        return low
    if spec.kind == "sha256":
        low = text.lower()
        if low == NO_CHAT_TEMPLATE:
            return low
        if not _SHA256_RE.match(low):
            raise IdentityError(name, f"must be 64 hex digits or 'none', got {text!r}")
        return low
    if spec.kind == "dtype":
        low = text.lower().removeprefix("torch.")
        if low == "auto":
            raise IdentityError(
                name, "'auto' is not a resolved dtype; pin the dtype vLLM actually uses"
            )
        if low not in _DTYPE_ALIASES:
            raise IdentityError(name, f"unknown KV-cache dtype {text!r}")
        return _DTYPE_ALIASES[low]
    if name == "model_id" and "@" in text:
        raise IdentityError(name, f"must not contain '@' (LMCache reserves it), got {text!r}")
    return text


@dataclass(frozen=True)
class CacheIdentity:
    """The complete compatibility identity of one serving configuration."""

    model_id: str
    model_revision: str
    tokenizer_id: str
    tokenizer_revision: str
    kv_cache_dtype: str
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    connector: str
    build: str
    max_model_len: int
    chat_template_sha256: str
    model_dtype: str
    quantization: str
    model_config_sha256: str
    weights_sha256: str
    mm_processor_kwargs_sha256: str = NO_MM_PROCESSOR_KWARGS
    draft_sha256: str = NO_DRAFT

    def __post_init__(self) -> None:
        for spec in FIELDS:
            raw = getattr(self, spec.name)
            canonical = normalize_field(spec.name, raw)
            if canonical != raw:
                object.__setattr__(self, spec.name, canonical)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> CacheIdentity:
        """Build from field names; unknown names and missing fields raise IdentityError (an
        :data:`OPTIONAL_FIELDS` field that is absent has its earlier value)."""
        for key in values:
            if key not in _BY_NAME:
                raise IdentityError(key, "is not an identity field")
        for spec in FIELDS:
            if spec.name not in values and spec.name not in OPTIONAL_FIELDS:
                raise IdentityError(spec.name, "is missing")
        merged = {**OPTIONAL_FIELDS, **values}
        return cls(**{name: merged[name] for name in FIELD_NAMES})  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, str | int]:
        """Every field, except an :data:`OPTIONAL_FIELDS` field at its earlier value."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if OPTIONAL_FIELDS.get(name) != value}

    def canonical_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @property
    def namespace(self) -> str:
        digest = hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()
        return NAMESPACE_PREFIX + digest[:32]

    def lmcache_model_name(self) -> str:
        return f"{self.model_id}/{self.namespace}"


def diff_identities(a: Mapping[str, object], b: Mapping[str, object]) -> list[tuple[str, object, object]]:
    """Fields whose canonical values differ between two (possibly partial) field mappings (an
    absent :data:`OPTIONAL_FIELDS` field is at its earlier value, as a record leaves it)."""
    out: list[tuple[str, object, object]] = []
    for name in FIELD_NAMES:
        va, vb = a.get(name, OPTIONAL_FIELDS.get(name)), b.get(name, OPTIONAL_FIELDS.get(name))
        ca: object
        cb: object
        try:
            ca = normalize_field(name, va) if va is not None else None
        except IdentityError:
            ca = va
        try:
            cb = normalize_field(name, vb) if vb is not None else None
        except IdentityError:
            cb = vb
        if ca != cb:
            out.append((name, va, vb))
    return out


# --------------------------------------------------------------------------- merging


@dataclass
class IdentityResolution:
    """The outcome of resolving an identity: either ``identity`` or the ``problems`` that
    turned caching off.  ``sources`` records where each field's value came from."""

    identity: CacheIdentity | None
    problems: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.identity is not None and not self.problems

    def summary(self) -> str:
        if self.enabled and self.identity is not None:
            return f"caching ON, namespace {self.identity.namespace}"
        return "caching OFF: " + "; ".join(self.problems)


def merge_sources(
    pins: Mapping[str, object], live: Mapping[str, Any], *, live_label: str = "live"
) -> IdentityResolution:
    """Combine pinned and live-derived fields into one identity, failing closed.

    For each field: both present and equal (canonically) → that value; both present and
    different → a problem naming the field; exactly one present → that one; neither → a
    problem ("missing").  Any problem means no identity.
    """
    problems: list[str] = []
    sources: dict[str, str] = {}
    values: dict[str, object] = {}
    for spec in FIELDS:
        pin, seen = pins.get(spec.name), live.get(spec.name)
        try:
            cpin = normalize_field(spec.name, pin) if pin is not None else None
        except IdentityError as exc:
            problems.append(f"pin {exc}")
            continue
        try:
            cseen = normalize_field(spec.name, seen) if seen is not None else None
        except IdentityError as exc:
            problems.append(f"{live_label} {exc}")
            continue
        if cpin is not None and cseen is not None and cpin != cseen:
            problems.append(
                f"identity field '{spec.name}': pinned {cpin!r} but {live_label} value is {cseen!r}"
            )
            continue
        if cpin is None and cseen is None:
            problems.append(f"identity field '{spec.name}' ({spec.env}): is missing")
            continue
        values[spec.name] = cpin if cpin is not None else cseen
        sources[spec.name] = "pin" if cseen is None else (live_label if cpin is None else "both")
    if problems:
        return IdentityResolution(None, problems, sources)
    return IdentityResolution(CacheIdentity.from_mapping(values), [], sources)
