"""The on-disk format of one kvpersist L2 file: the self-describing 4096-byte header, then the payload.

File layout::

    [0, 4096)   header: magic "KVPCACHE", u32 format version, u32 JSON length, JSON, zero padding,
                and in the last 16 bytes the xxh3-128 digest of bytes [0, 4080)
    [4096, …)   payload: exactly ``payload_len`` bytes of KV data (page aligned for O_DIRECT/GDS)

Invariants
----------
* A header is accepted only if magic, version, its own digest, and every key field match the
  key that is being read, and the payload length equals the size LMCache expects.  The payload
  is accepted only if its xxh3-128 digest equals the header's.  Anything else is corruption.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from .layout import FormatError, KeyFields, format_name

MAGIC = b"KVPCACHE"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
_DIGEST_SIZE = 16
_PREFIX = struct.Struct("<8sII")
CHECKSUM_ALGORITHM = "xxh3_128"


def payload_digest(data: Any) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


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
