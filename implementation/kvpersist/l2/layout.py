"""The layout of a cache tree: file names, shard directories, temp and quarantine names.

File name (flat layout, or under ``ab/cd/`` with sharding)::

    <model part>_<kv_rank:08x>_<group:x>_<chunk hash hex>[@<salt part>].kvp

LMCache forbids ``@`` in model names and salts; ``_`` separates the fixed-format fields after
the model part, so a name is parsed from the right.  The parts:

* **model part**: LMCache's model name with ``/`` written ``--`` (the form of every earlier
  version, and LMCache's own), when that is unambiguous: the name has no ``--``, ``-/``,
  ``/-``, ``//`` and no ``%``.  Otherwise ``%`` and the name with ``%`` written ``%25`` and ``/``
  written ``%2F`` (``team--x/chat`` is ``%team--x%2Fchat``).
* **salt part**: the salt as it is, unless it holds ``/`` or ``%`` (then escaped the same way).
* **hashed parts**: a name longer than :data:`MAX_NAME_BYTES` (so that the temp and quarantine
  names built on it stay within the file system's 255 bytes) writes its salt, then if needed its
  model, as ``%h`` and 32 hex digits of the part's sha256 (the model keeps its namespace:
  ``%h<hex>%2Fkvp-<32 hex>``).  The file's header holds the full key, and a reader of the name
  alone (the start-up scan) takes the key from there (:func:`needs_header`).

Invariants
----------
* ``parse_name(format_name(k)) == k`` for every key LMCache can produce whose name has no
  hashed part, and :func:`parse_name` accepts only names :func:`format_name` writes (the
  round trip is checked): a name an earlier version wrote ambiguously (a model id with ``--``)
  is refused (``legacy-name``) rather than read as another key; the scan reads its header.
* Names are parsed strictly (hex fields are ASCII hex only); the C walker (``_walk.c``) accepts
  exactly the names :func:`split_stem` accepts.
* Data live directly in the root and, sharded, in ``root/xx/yy``; ``quarantine/`` directly under
  the root is never data; a temp file is a cache file's name followed by :data:`TMP_MARK` and
  hex digits (:func:`is_temp_name`, the mark anchored at the end), so a name a user chose (a
  salt ``team.tmp.a``) never makes a live file look like one.
"""

from __future__ import annotations

import functools
import hashlib
import re
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
#: The longest cache file name written, in bytes: its temp name adds 17 and its quarantine name
#: about 45, within NAME_MAX (255).
MAX_NAME_BYTES = 200
_ESCAPE = "%"
_HASHED = "%h"
_DIGEST_HEX = 32
_ESCAPED = re.compile(r"%(25|2F)")


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


def _escape(text: str) -> str:
    return _ESCAPE + text.replace("%", "%25").replace("/", "%2F")


def _unescape(part: str) -> str:
    """Inverse of :func:`_escape`; FormatError for a ``%`` that is not one of its escapes."""
    body = part[len(_ESCAPE):]
    if "%" in _ESCAPED.sub("", body):
        raise FormatError("bad-name", part)
    return _ESCAPED.sub(lambda m: "%" if m[1] == "25" else "/", body)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:_DIGEST_HEX]


@functools.lru_cache(maxsize=65536)
def sanitize_model_name(model_name: str) -> str:
    """LMCache model name → the model part of a file name (see the module docstring)."""
    if any(s in model_name for s in ("%", "--", "-/", "/-", "//")):
        return _escape(model_name)
    return model_name.replace("/", "--")


def _hashed_model(model_name: str) -> str:
    namespace = split_model_name(model_name)[0]
    return _HASHED + _digest(model_name) + (f"%2F{namespace}" if namespace else "")


def _salt_part(salt: str) -> str:
    return _escape(salt) if ("/" in salt or "%" in salt) else salt


def format_name(key: KeyFields) -> str:
    """The file name of ``key`` (see the module docstring); at most :data:`MAX_NAME_BYTES`."""
    tail = f"_{key.kv_rank:08x}_{key.object_group_id:x}_{key.chunk_hash.hex()}"
    salt = key.cache_salt
    salts = [_salt_part(salt), _HASHED + _digest(salt)] if salt else [""]
    models = [sanitize_model_name(key.model_name), _hashed_model(key.model_name)]
    name = ""
    for model, salt_part in ((models[0], salts[0]), (models[0], salts[-1]),
                             (models[1], salts[0]), (models[1], salts[-1])):
        name = f"{model}{tail}{'@' + salt_part if salt_part else ''}{SUFFIX}"
        if len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES:
            return name
    return name  # a chunk hash too long for any name: the file system refuses it


def is_hashed(part: str) -> bool:
    """Whether a model or salt part of a name is a digest (the full value is in the header)."""
    return part.startswith(_HASHED)


@functools.lru_cache(maxsize=65536)
def model_name_from_safe(safe_model: str) -> str:
    """The LMCache model name a model part names: the inverse of :func:`sanitize_model_name`;
    for a hashed part, ``#<hex>`` and its namespace (``#<hex>/kvp-...``: the real name is in
    the header); for an escaped part that does not unescape, the part itself."""
    if is_hashed(safe_model):
        rest = safe_model[len(_HASHED) + _DIGEST_HEX:]
        return "#" + safe_model[len(_HASHED):len(_HASHED) + _DIGEST_HEX] + (
            "/" + rest[3:] if rest.startswith("%2F") else "")
    if safe_model.startswith(_ESCAPE):
        try:
            return _unescape(safe_model)
        except FormatError:
            return safe_model
    return safe_model.replace("--", "/")


def exact_model_part(safe_model: str) -> bool:
    """Whether the model part ``safe_model`` names its model exactly: written by this version's
    :func:`sanitize_model_name` and not hashed.  Every earlier version's name of a model id
    without ``--``, ``-/``, ``/-``, ``//`` or ``%`` is one."""
    return not is_hashed(safe_model) and sanitize_model_name(
        model_name_from_safe(safe_model)) == safe_model


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
    """The key a cache file name names, given without its suffix (".kvp" or ".bin"), read the
    way the name is written (``--`` or escapes); FormatError("bad-name") if :func:`split_stem`
    refuses it, ("hashed-name") if a part is a digest."""
    fields = split_stem(stem)
    if fields is None:
        raise FormatError("bad-name", stem)
    model, rank, group, hash_hex, salt = fields
    if is_hashed(model) or is_hashed(salt):
        raise FormatError("hashed-name", stem)
    if salt.startswith(_ESCAPE):
        salt = _unescape(salt)
    return KeyFields(model_name_from_safe(model), int(rank, 16), int(group, 16),
                     bytes.fromhex(hash_hex), salt)


_TEMP_TAIL = frozenset("0123456789abcdef")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is the atomic writer's temp name of a cache file,
    ``<name>.kvp.tmp.<hex>`` (the C walker's ``is_temp_name``)."""
    head, mark, tail = name.rpartition(SUFFIX + TMP_MARK)
    return bool(mark and head and tail) and _TEMP_TAIL.issuperset(tail)


def parse_name(name: str) -> KeyFields:
    """Invert :func:`format_name`; raises FormatError for anything else: temp files, names
    with a hashed part (``hashed-name``: the key is in the header), and names this version
    would not write for the key they spell (``legacy-name``: an earlier version's ambiguous
    name, whose header says which key it holds)."""
    if not name.endswith(SUFFIX):
        raise FormatError("not-a-cache-file", name)
    try:
        key = key_of_stem(name[: -len(SUFFIX)])
    except FormatError as exc:
        raise FormatError(exc.reason if exc.reason == "hashed-name" else "bad-name",
                          name) from None
    model, rank, group, hash_hex, salt = split_stem(name[: -len(SUFFIX)]) or ("", "", "", "", "")
    as_written = (f"{model}_{rank.lower()}_{group.lower()}_{hash_hex.lower()}"
                  f"{'@' + salt if salt else ''}{SUFFIX}")  # hex fields in any case
    if format_name(key) != as_written:
        raise FormatError("legacy-name", name)
    return key


def legacy_name(key: KeyFields) -> str:
    """The name every earlier version wrote for ``key``: ``/`` as ``--``, the salt as it is
    (the migration reads it; this version never writes one that is ambiguous)."""
    salt = f"@{key.cache_salt}" if key.cache_salt else ""
    return (f"{key.model_name.replace('/', '--')}_{key.kv_rank:08x}_{key.object_group_id:x}_"
            f"{key.chunk_hash.hex()}{salt}{SUFFIX}")


def needs_header(name: str) -> bool:
    """Whether the key of the cache file ``name`` must be read from its header: a hashed part,
    or a name :func:`parse_name` refuses as ``legacy-name``."""
    try:
        parse_name(name)
    except FormatError as exc:
        return exc.reason in ("hashed-name", "legacy-name")
    return False


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
