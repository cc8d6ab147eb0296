"""The layout of a cache tree: file names, shard directories, temp and quarantine names.

File name (flat layout, or under ``ab/cd/`` with sharding)::

    <safe_model_name>_<kv_rank:08x>_<group:x>_<chunk hash hex>[@<salt>].kvp

``safe_model_name`` is LMCache's model name with ``/`` replaced by ``--``.  LMCache forbids ``@``
in model names and salts; ``_`` separates the fixed-format fields after the model name, so a name
is parsed from the right and round-trips exactly.

Invariants
----------
* ``parse_name(format_name(k)) == k`` for every key LMCache can produce.
* Names are parsed strictly (hex fields are ASCII hex only); the C walker (``_walk.c``) accepts
  exactly the names :func:`split_stem` accepts.
* Data live directly in the root and, sharded, in ``root/xx/yy``; ``quarantine/`` directly under
  the root is never data; a temp file is a cache file's name followed by :data:`TMP_MARK` and
  hex digits (:func:`is_temp_name`, the mark anchored at the end), so a name a user chose (a
  salt ``team.tmp.a``) never makes a live file look like one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..atomic import TMP_MARK as TMP_MARK
from ..config.paths import STATE_DIR_NAME

SUFFIX = ".kvp"
NIXL_SUFFIX = ".bin"  # nixl_store_dynamic's files, same naming
CACHE_SUFFIXES = (SUFFIX, NIXL_SUFFIX)
QUARANTINE_DIR = "quarantine"  # directly under the root; never scanned as data
LOCK_NAME = ".kvpersist.lock"
#: Directly under the root: the store's own state (the index snapshot); never data.
STATE_DIR = STATE_DIR_NAME


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


Row = tuple[str, int, int, str]


def row_of(key: KeyFields) -> Row:
    """The row ``key`` belongs to: every field but the chunk hash.  One rank of one object
    group of one model and salt; a request's hits are a prefix per row, not across rows."""
    return key.model_name, key.kv_rank, key.object_group_id, key.cache_salt


@functools.lru_cache(maxsize=65536)
def split_model_name(model_name: str) -> tuple[str, str]:
    """LMCache model name → (kvpersist namespace or '', model id)."""
    head, _, last = model_name.rpartition("/")
    if last.startswith("kvp-") and head:
        return last, head
    return "", model_name


def sanitize_model_name(model_name: str) -> str:
    """LMCache model name → file-name prefix (``/`` becomes ``--``), as LMCache's adapters do."""
    return model_name.replace("/", "--")


def format_name(key: KeyFields) -> str:
    safe_model = sanitize_model_name(key.model_name)
    base = f"{safe_model}_{key.kv_rank:08x}_{key.object_group_id:x}_{key.chunk_hash.hex()}"
    if key.cache_salt:
        base += f"@{key.cache_salt}"
    return base + SUFFIX


@functools.lru_cache(maxsize=65536)
def model_name_from_safe(safe_model: str) -> str:
    """Inverse of :func:`sanitize_model_name` (``--`` back to ``/``)."""
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


_TEMP_TAIL = frozenset("0123456789abcdef")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is the atomic writer's temp name of a cache file,
    ``<name>.kvp.tmp.<hex>`` (the C walker's ``is_temp_name``)."""
    head, mark, tail = name.rpartition(SUFFIX + TMP_MARK)
    return bool(mark and head and tail) and _TEMP_TAIL.issuperset(tail)


def parse_name(name: str) -> KeyFields:
    """Invert :func:`format_name`; raises FormatError for anything else (temp files too)."""
    if not name.endswith(SUFFIX):
        raise FormatError("not-a-cache-file", name)
    try:
        return key_of_stem(name[: -len(SUFFIX)])
    except FormatError:
        raise FormatError("bad-name", name) from None


def shard_dirs(chunk_hash: bytes) -> tuple[str, str]:
    """Two-level shard directories from the chunk hash (``ab``, ``cd``), as in LMCache's GDS backend."""
    text = chunk_hash.hex().ljust(4, "0")
    return text[0:2], text[2:4]


def shard_path_parts(key: KeyFields, sharded: bool) -> tuple[str, ...]:
    """Path components of ``key``'s file below the root."""
    name = format_name(key)
    return (*shard_dirs(key.chunk_hash), name) if sharded else (name,)


def is_data_dir(root: str, directory: str, sharded: bool) -> bool:
    """True for the directories that hold data: the root and, sharded, ``root/xx/yy``."""
    if directory == root:
        return True
    if not sharded or not directory.startswith(root + "/"):
        return False
    parts = directory[len(root) + 1:].split("/")
    return len(parts) == 2 and all(len(p) == 2 for p in parts)
