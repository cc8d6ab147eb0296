"""The on-disk format of kvpersist L2 files: names and the self-describing 4096-byte header.

File name (flat layout, or under ``ab/cd/`` with sharding)::

    <safe_model_name>_<kv_rank:08x>_<group:x>_<chunk hash hex>[@<salt>].kvp

``safe_model_name`` is LMCache's model name with ``/`` replaced by ``--``.  LMCache forbids ``@``
in model names and salts; ``_`` separates the fixed-format fields after the model name, so a name
is parsed from the right and round-trips exactly.

File layout::

    [0, 4096)   header: magic "KVPCACHE", u32 format version, u32 JSON length, JSON, zero padding,
                and in the last 16 bytes the xxh3-128 digest of bytes [0, 4080)
    [4096, …)   payload: exactly ``payload_len`` bytes of KV data (page aligned for O_DIRECT/GDS)

Invariants
----------
* A header is accepted only if magic, version, its own digest, and every key field match the
  key that is being read, and the payload length equals the size LMCache expects.  The payload
  is accepted only if its xxh3-128 digest equals the header's.  Anything else is corruption.
* ``parse_name(format_name(k)) == k`` for every key LMCache can produce.
"""

from __future__ import annotations

import functools
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from .identity import sanitize_model_name

MAGIC = b"KVPCACHE"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
_DIGEST_SIZE = 16
_PREFIX = struct.Struct("<8sII")
SUFFIX = ".kvp"
TMP_MARK = ".tmp."
QUARANTINE_DIR = "quarantine"  # directly under the root; never scanned as data
CHECKSUM_ALGORITHM = "xxh3_128"


class FormatError(ValueError):
    """A file or name is not a valid kvpersist L2 object; ``reason`` is a short tag."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class KeyFields(NamedTuple):
    """The fields of LMCache's ``ObjectKey``, independent of LMCache (a tuple: cheap to build
    and hash, which the start-up scan does once per file)."""

    model_name: str
    kv_rank: int
    object_group_id: int
    chunk_hash: bytes
    cache_salt: str = ""

    @property
    def namespace(self) -> str:
        """The kvpersist namespace (last path component of the model name), or ''."""
        return split_model_name(self.model_name)[0]


@functools.lru_cache(maxsize=65536)
def split_model_name(model_name: str) -> tuple[str, str]:
    """LMCache model name → (kvpersist namespace or '', model id)."""
    head, _, last = model_name.rpartition("/")
    if last.startswith("kvp-") and head:
        return last, head
    return "", model_name


def format_name(key: KeyFields) -> str:
    safe_model = sanitize_model_name(key.model_name)
    base = f"{safe_model}_{key.kv_rank:08x}_{key.object_group_id:x}_{key.chunk_hash.hex()}"
    if key.cache_salt:
        base += f"@{key.cache_salt}"
    return base + SUFFIX


@functools.lru_cache(maxsize=65536)
def model_name_from_safe(safe_model: str) -> str:
    """Inverse of :func:`kvpersist.identity.sanitize_model_name` (``--`` back to ``/``)."""
    return safe_model.replace("--", "/")


_HEX_DIGITS = "0123456789abcdefABCDEF"


def split_stem(stem: str) -> tuple[str, str, str, str, str] | None:
    """(safe model, rank hex, group hex, hash hex, salt) of a cache file name without its suffix
    (".kvp", or nixl_store_dynamic's ".bin"), or None if it does not have the shape
    ``<model>_<8 hex>_<hex>_<even-length hex>[@<salt>]`` (model and salt without "@", salt not
    empty).  The C walker (``_walk.c``, ``live_model_len``) accepts exactly the same names."""
    salt = ""
    if "@" in stem:
        stem, _, salt = stem.partition("@")
        if not salt or "@" in salt:
            return None
    parts = stem.rsplit("_", 3)
    if len(parts) != 4:
        return None
    model, rank, group, hash_hex = parts
    if (not model or len(rank) != 8 or not group or len(hash_hex) % 2
            or rank.strip(_HEX_DIGITS) or group.strip(_HEX_DIGITS) or hash_hex.strip(_HEX_DIGITS)):
        return None
    return model, rank, group, hash_hex, salt


def key_of_stem(stem: str) -> KeyFields:
    """The key a cache file name names, given without its suffix (".kvp" or ".bin");
    FormatError("bad-name") if :func:`split_stem` refuses it."""
    fields = split_stem(stem)
    if fields is None:
        raise FormatError("bad-name", stem)
    model, rank, group, hash_hex, salt = fields
    return KeyFields(model_name_from_safe(model), int(rank, 16), int(group, 16),
                     bytes.fromhex(hash_hex), salt)


def parse_name(name: str) -> KeyFields:
    """Invert :func:`format_name`; raises FormatError for anything else (temp files too)."""
    if not name.endswith(SUFFIX) or TMP_MARK in name:
        raise FormatError("not-a-cache-file", name)
    try:
        return key_of_stem(name[: -len(SUFFIX)])
    except FormatError:
        raise FormatError("bad-name", name) from None


def shard_dirs(chunk_hash: bytes) -> tuple[str, str]:
    """Two-level shard directories from the chunk hash (``ab``, ``cd``), as in LMCache's GDS backend."""
    text = chunk_hash.hex().ljust(4, "0")
    return text[0:2], text[2:4]


def payload_digest(data: Any) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


def payload_hasher() -> Any:
    """A streaming hasher whose ``digest()`` equals :func:`payload_digest` of the whole."""
    return xxhash.xxh3_128()


def build_header(key: KeyFields, payload_len: int, digest: bytes,
                 layout: dict[str, Any] | None = None, created: float | None = None) -> bytes:
    meta = {
        "model_name": key.model_name,
        "kv_rank": key.kv_rank,
        "object_group_id": key.object_group_id,
        "chunk_hash": key.chunk_hash.hex(),
        "cache_salt": key.cache_salt,
        "namespace": key.namespace,
        "payload_len": payload_len,
        "layout": layout or {},
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "checksum": digest.hex(),
        "created": created if created is not None else time.time(),
    }
    body = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    room = HEADER_SIZE - _DIGEST_SIZE - _PREFIX.size
    if len(body) > room:
        raise FormatError("header-too-large", f"{len(body)} > {room} bytes")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body
    head += b"\0" * (HEADER_SIZE - _DIGEST_SIZE - len(head))
    return head + xxhash.xxh3_128_digest(head)


@dataclass(frozen=True)
class Header:
    key: KeyFields
    payload_len: int
    checksum: bytes
    layout: dict[str, Any]
    created: float


def parse_header(raw: bytes) -> Header:
    """Parse and self-check a header; raises FormatError with a reason tag."""
    if len(raw) < HEADER_SIZE:
        raise FormatError("short-header", f"{len(raw)} bytes")
    magic, version, length = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise FormatError("bad-magic")
    if version != FORMAT_VERSION:
        raise FormatError("bad-version", str(version))
    body_end = HEADER_SIZE - _DIGEST_SIZE
    if xxhash.xxh3_128_digest(raw[:body_end]) != raw[body_end:HEADER_SIZE]:
        raise FormatError("header-checksum")
    if not 0 < length <= body_end - _PREFIX.size:
        raise FormatError("bad-header-length", str(length))
    try:
        meta = json.loads(raw[_PREFIX.size:_PREFIX.size + length])
        key = KeyFields(
            model_name=str(meta["model_name"]),
            kv_rank=int(meta["kv_rank"]),
            object_group_id=int(meta["object_group_id"]),
            chunk_hash=bytes.fromhex(meta["chunk_hash"]),
            cache_salt=str(meta["cache_salt"]),
        )
        if meta["checksum_algorithm"] != CHECKSUM_ALGORITHM:
            raise FormatError("bad-checksum-algorithm", str(meta["checksum_algorithm"]))
        return Header(key, int(meta["payload_len"]), bytes.fromhex(meta["checksum"]),
                      dict(meta.get("layout") or {}), float(meta["created"]))
    except (KeyError, ValueError, TypeError) as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError("bad-header-json", str(exc)) from None


def check_header(header: Header, key: KeyFields, expected_len: int) -> None:
    """Raise FormatError unless ``header`` describes exactly ``key`` with ``expected_len`` bytes."""
    if header.key != key:
        raise FormatError("key-mismatch", f"file holds {format_name(header.key)}")
    if header.payload_len != expected_len:
        raise FormatError("length-mismatch", f"{header.payload_len} != {expected_len}")
