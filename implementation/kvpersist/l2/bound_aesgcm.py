"""Encryption at rest bound to the object key: ``kvp-aesgcm``, a serde for LMCache's L2 tier.

LMCache's ``aesgcm`` serde encrypts each chunk with a key derived per ``cache_salt`` and no
associated data, so a ciphertext does not say which chunk it is: a file renamed and re-headered
to another chunk's key (a tampered disk, a peer on a shared tree) decrypts as valid KV of the
wrong chunk.  ``kvp-aesgcm`` authenticates every ciphertext together with its whole object key.

Invariants
----------
* The associated data is the canonical object key: model name (which carries the namespace),
  kv rank, object group, chunk hash and salt.  A ciphertext decrypts only under the key it was
  written for; under any other it fails its tag, and that is a miss, never other KV.
* Keys are derived per salt from the master key with HKDF-SHA256 under kvpersist's own ``info``
  prefix, so no derived key equals one LMCache's ``aesgcm`` derives; frames carry their own
  version byte (0x81), so LMCache's frames (version 1) are refused, not misread.
* Frames are ``[0x81][key id][iv][ciphertext+tag]``; the key id names the master key (a digest
  of a key HKDF derives from it for nothing else).  A frame of another master key (a
  misconfigured key, another tree) is a miss and stays on disk; a frame of this master key
  whose tag fails under its object key was renamed, re-headered or changed: it is reported to
  the listeners (:func:`on_rejected`), and kvpersist's L2 adapter quarantines its file.
* The master key file must belong to the server's account and be readable by no one else
  (:func:`check_master_key`); the server refuses to start otherwise, naming the file.
* ``aesgcm`` in kvpersist's settings means this serde (``AESGCM_ALIASES``): files LMCache's
  unbound variant wrote are misses.  Registered when kvpersist's adapter module is imported,
  which LMCache does before it wraps the adapter in a serde.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.adapters import BOUND_AESGCM as SERDE_TYPE

_VERSION = 0x81
_KEY_ID_LEN = 8
_IV_LEN = 12
_TAG_LEN = 16
_IV_AT = 1 + _KEY_ID_LEN
_HDR_LEN = _IV_AT + _IV_LEN
_HKDF_INFO_PREFIX = b"kvpersist-l2-aesgcm-bound-v1:"
_KEY_ID_INFO = b"kvpersist-l2-aesgcm-key-id-v1"
_AAD_DOMAIN = b"kvpersist-object-key-v1"

_listeners: list[Callable[[Any], None]] = []
_listeners_lock = threading.Lock()


class MasterKeyError(ValueError):
    """The master key file is unsafe or unreadable; the message names it."""


def associated_data(key: Any) -> bytes:
    """The canonical bytes of an LMCache ``ObjectKey`` (or kvpersist ``KeyFields``)."""
    parts = [_AAD_DOMAIN, str(key.model_name).encode(), str(int(key.kv_rank)).encode(),
             str(int(key.object_group_id)).encode(), bytes(key.chunk_hash).hex().encode(),
             str(key.cache_salt or "").encode()]
    return b"\0".join(len(p).to_bytes(4, "big") + p for p in parts)


def on_rejected(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(object_key)`` for every chunk whose tag fails; returns an unsubscribe."""
    with _listeners_lock:
        _listeners.append(listener)

    def remove() -> None:
        with _listeners_lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


def _rejected(key: Any) -> None:
    with _listeners_lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(key)
        except Exception:  # a listener's failure must not turn a miss into an error
            continue


def check_master_key(path: str | Path) -> bytes:
    """The master key's bytes, after checking it belongs to this account and no one else may
    read or write it; :class:`MasterKeyError` names the file otherwise."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise MasterKeyError(f"master key {p}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise MasterKeyError(f"master key {p} is not a regular file")
    if st.st_uid != os.geteuid():
        raise MasterKeyError(f"master key {p} belongs to uid {st.st_uid}, not to the server's "
                             f"account (uid {os.geteuid()}): chown it to that account")
    if st.st_mode & 0o077:
        raise MasterKeyError(f"master key {p} has mode {stat.S_IMODE(st.st_mode):04o}: others "
                             f"may read it; chmod 600 {p}")
    data = p.read_bytes()
    if len(data) < 16:
        raise MasterKeyError(f"master key {p} holds {len(data)} bytes; at least 16 are needed")
    return data


def _create(kwargs: dict[str, object]) -> Any:
    """LMCache's serde factory for :data:`SERDE_TYPE` (kwargs as LMCache's ``aesgcm`` takes)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from lmcache.v1.distributed.serde.aesgcm import _plaintext_bytes
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.base import Deserializer, Serializer
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    aes_bits = int(str(kwargs.get("aes_bits", 256)))
    if aes_bits not in (128, 256):
        raise ValueError(f"{SERDE_TYPE}: aes_bits must be 128 or 256, got {aes_bits}")
    master = check_master_key(str(kwargs.get("master_key_path", "")))
    keys = HkdfKeyProvider(master, key_len=aes_bits // 8, info_prefix=_HKDF_INFO_PREFIX)
    key_id = hashlib.sha256(HkdfKeyProvider(master, key_len=32, info_prefix=_KEY_ID_INFO)
                            .get_key("")).digest()[:_KEY_ID_LEN]

    class BoundSerializer(Serializer):  # type: ignore[misc]
        def serialize(self, src: Any, dst: Any, key: Any) -> int:
            iv = os.urandom(_IV_LEN)
            sealed = AESGCM(keys.get_key(key.cache_salt)).encrypt(
                iv, bytes(src.byte_array), associated_data(key))
            out = memoryview(dst.byte_array).cast("B")
            out[0:1] = bytes((_VERSION,))
            out[1:_IV_AT] = key_id
            out[_IV_AT:_HDR_LEN] = iv
            out[_HDR_LEN:_HDR_LEN + len(sealed)] = sealed
            return _HDR_LEN + len(sealed)

        def estimate_serialized_size(self, layout_desc: Any) -> int:
            return int(_plaintext_bytes(layout_desc)) + _HDR_LEN + _TAG_LEN

    class BoundDeserializer(Deserializer):  # type: ignore[misc]
        def deserialize(self, src: Any, dst: Any, key: Any) -> None:
            from cryptography.exceptions import InvalidTag

            out = memoryview(dst.byte_array).cast("B")
            blob = bytes(src.byte_array)
            end = _HDR_LEN + len(out) + _TAG_LEN
            if len(blob) < end or blob[0] != _VERSION:
                raise ValueError(f"{SERDE_TYPE}: not a frame of this serde")
            if blob[1:_IV_AT] != key_id:
                raise ValueError(f"{SERDE_TYPE}: written under another master key")
            try:
                plain = AESGCM(keys.get_key(key.cache_salt)).decrypt(
                    blob[_IV_AT:_HDR_LEN], blob[_HDR_LEN:end], associated_data(key))
            except InvalidTag:
                _rejected(key)
                raise
            out[:len(plain)] = plain

    workers = int(str(kwargs.get("max_workers", 1)))
    return AsyncSerdeProcessor(BoundSerializer(), BoundDeserializer(), max_workers=workers)


def register() -> None:
    """Make :data:`SERDE_TYPE` known to LMCache's serde factory (once per process)."""
    from lmcache.v1.distributed.serde.factory import (
        get_registered_serde_types,
        register_serde_factory,
    )

    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, _create)
