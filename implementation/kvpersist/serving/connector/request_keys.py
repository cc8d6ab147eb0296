"""What a request adds to LMCache's key besides its tokens: its LoRA adapter and its
multimodal items, both by content.

LMCache keys a chunk by the model name (kvpersist's carries the namespace), the rank, the
object group, a hash of the chunk's token IDs and the request's ``cache_salt``.  For a
multimodal request LMCache replaces each placeholder span of the token IDs with values derived
from vLLM's ``identifier`` of the item (``apply_mm_hashes_to_token_ids``).  That identifier is a
label, not always a content hash: with prefix caching off and no processor cache it is a counter
that restarts with every process (``renderer0-mm-1-image-0``), and a client's ``uuid`` is taken
verbatim.  So kvpersist keys every item itself, by the processed inputs the engine computes with
(:func:`mm_content_digest`), and folds that digest into the salt; the identifier decides
nothing.  A LoRA adapter reaches no part of LMCache's key either: it is folded into the salt
the same way (:func:`request_salt`), which LMCache keeps apart everywhere (key, file name,
lookup).

Invariants
----------
* A request without an adapter keeps its own salt, byte for byte, unless that salt starts with
  :data:`RESERVED_PREFIX`; files written before per-request keys existed stay reachable.
* Every other request's salt is ``kvpk-<adapter tag>-<32 hex>``, the hex a sha256 over the
  request's own salt and the adapter's full digest: two requests share a salt only when both
  agree, and no user-chosen salt can equal a derived one (a user salt with the reserved prefix
  is derived too).
* A request with multimodal items keeps no salt of its own: its salt is derived from the
  content digest of every item (modality, placeholder position and length, and each processed
  input tensor's dtype, shape and bytes), so two requests share KV across an item only when the
  engine computed with the same inputs.  Each item's own digest is also written over its
  placeholder tokens in LMCache's tracker, where LMCache wrote values of vLLM's label
  (:class:`RequestKey`), so the same image under a label that restarts with the process (a
  counter) still finds its KV after a restart.  An item whose inputs the scheduler cannot see
  (vLLM's ``shm`` processor cache hands it a handle; an item without data) is uncacheable,
  never keyed by its label.
* An adapter is keyed by its content: sha256 over every file of its folder (relative path and
  bytes) with the engine's LoRA settings that change the adapter's computation; never by its
  name or id alone.
* The digest is taken once per engine process and adapter, off the scheduler's thread for an
  adapter larger than :data:`INLINE_DIGEST_BYTES` (its requests are uncached until it is
  ready); each file's digest is remembered per file version, so a restart reads nothing again.
  When the adapter's files change afterwards, the engine may still run the weights it loaded
  before, so that adapter's requests are neither looked up nor stored from then on
  (:class:`Uncacheable`).  An adapter that is not a local folder, and a request with prompt
  embeddings (no content key exists for them), are uncacheable too.
* vLLM's workers keep adapters by their integer id.  An id that names a second adapter (name
  or folder) and an adapter reloaded in place (``load_inplace``) may run weights no digest
  describes: that id's requests are not cached from then on, and requests keyed before store
  nothing more (``on_adapter_void``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...identity.adapter_records import TAG_LEN
from ...identity.engine_fields import ENGINE_FIELDS, PerRequest
from ...identity.weights_digest import FileDigestCache, weights_digest

logger = logging.getLogger("vllm.kvpersist.connector")

#: Salts that start with this are kvpersist's own (derived) salts.
RESERVED_PREFIX = "kvpk-"
#: The tag of a derived salt without an adapter (a user salt with the reserved prefix).
NO_ADAPTER_TAG = "base"
#: The tag of a derived salt with multimodal items and no adapter.
MM_TAG = "mm"
#: A derived salt with an adapter: ``kvpk-lora<first TAG_LEN hex of its digest>-<32 hex>``; the
#: one statement of that format (``kvp-admin report`` matches file names with it).
ADAPTER_SALT = re.compile(re.escape(RESERVED_PREFIX) + rf"lora([0-9a-f]{{{TAG_LEN}}})-")
_DOMAIN = "kvpersist-request-key-v2"
#: Adapters up to this size are digested on the scheduler's thread (about 20 ms at the
#: 1.8 GB/s sha256 runs here, and nothing at all once their files' digests are cached).
INLINE_DIGEST_BYTES = 32 << 20
#: Why an adapter id's requests are no longer cached.
VOID_DETAILS = {
    "lora_id_reused": "LoRA adapter id {id} named another adapter before ({name!r} now): vLLM "
                      "keeps adapters by id, so its requests are not cached until the engine "
                      "restarts",
    "lora_reloaded": "LoRA adapter {name!r} (id {id}) was reloaded in place: requests keyed "
                     "before store nothing more, and its requests are not cached until the "
                     "engine restarts",
}


@dataclass(frozen=True)
class Uncacheable:
    """This request must neither hit nor be stored; ``reason`` is a short metric label and
    ``detail`` says why, once, in the log."""

    reason: str
    detail: str


def request_salt(user_salt: str, adapter_digest: str | None,
                 content_digest: str | None = None) -> str:
    """The salt LMCache sees for a request with ``user_salt``, this adapter and these
    multimodal items (``content_digest``; see module invariants)."""
    if (adapter_digest is None and content_digest is None
            and not user_salt.startswith(RESERVED_PREFIX)):
        return user_salt
    parts: list[str | None] = [_DOMAIN, user_salt, adapter_digest]
    if content_digest is not None:
        parts.append(content_digest)
    payload = json.dumps(parts, ensure_ascii=True)
    digest = hashlib.sha256(payload.encode("ascii")).hexdigest()[:32]
    if adapter_digest is not None:
        tag = f"lora{adapter_digest[:TAG_LEN]}"
    else:
        tag = MM_TAG if content_digest is not None else NO_ADAPTER_TAG
    return f"{RESERVED_PREFIX}{tag}-{digest}"


class _NotContent(Exception):
    """A multimodal input holds something other than tensors and plain values."""


def _feed(h: Any, value: Any) -> None:
    """Frame ``value`` (nested tensors, lists, tuples, numbers, strings, None) into ``h``."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        h.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        # reshape: a 0-d tensor (Idefics3's ``num_patches``) cannot be viewed as bytes
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel()
                 else b"")
    elif isinstance(value, (list, tuple)):
        h.update(f"L{type(value).__name__}{len(value)}".encode())
        for inner in value:
            _feed(h, inner)
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"V{type(value).__name__}:{value!r}\0".encode())
    else:
        raise _NotContent(type(value).__name__)


def mm_item_digests(features: Any) -> list[str] | Uncacheable:
    """sha256 of each multimodal item as the engine computes with it: its modality and each
    processed input's name, field kind, dtype, shape and bytes (see module invariants)."""
    digests = []
    for feature in features:
        data = getattr(feature, "data", None)
        if data is None or not hasattr(data, "items"):
            return Uncacheable("mm_no_content", "a multimodal item reached the scheduler "
                               "without its inputs (vLLM's shm processor cache, or no data): "
                               "it cannot be keyed by content, so the request is neither "
                               "looked up nor stored")
        h = hashlib.sha256(b"kvpersist-mm-item-v1\0")
        h.update(f"{feature.modality}\0".encode())
        try:
            for name in sorted(data):
                elem = data[name]
                if not hasattr(elem, "data"):
                    raise _NotContent(type(elem).__name__)
                h.update(f"F{name}:{type(getattr(elem, 'field', None)).__name__}".encode())
                _feed(h, elem.data)
        except _NotContent as exc:
            return Uncacheable("mm_no_content", f"a multimodal item's inputs hold a "
                               f"{exc} (not tensors): the request is neither looked up nor "
                               "stored")
        digests.append(h.hexdigest())
    return digests


def mm_content_digest(features: Any, items: list[str] | None = None
                      ) -> str | Uncacheable | None:
    """sha256 over a request's multimodal items (their digests, ``items`` when already
    computed) and placeholder spans; None for a request without items."""
    if not features:
        return None
    if items is None:
        found = mm_item_digests(features)
        if isinstance(found, Uncacheable):
            return found
        items = found
    h = hashlib.sha256(b"kvpersist-mm-content-v1\0")
    for feature, digest in zip(features, items, strict=True):
        position = getattr(feature, "mm_position", None)
        h.update(f"{getattr(position, 'offset', None)}+{getattr(position, 'length', None)}"
                 f":{digest}\0".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class RequestKey:
    """What LMCache keys a request's chunks with, besides its token IDs and the namespace:
    the salt, and each multimodal item's content digest (written over its placeholder tokens
    in place of vLLM's label; None without items)."""

    salt: str
    item_digests: list[str] | None = None


def adapter_tag_of_salt(salt: str) -> str | None:
    """The adapter tag a derived salt carries (for reports), or None."""
    match = ADAPTER_SALT.match(salt)
    return match.group(1) if match else None


def folder_signature(folder: Path) -> tuple[tuple[str, int, int, int], ...]:
    """(relative path, size, mtime and ctime in ns) of every regular file below ``folder``,
    sorted."""
    rows = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()
            rows.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns,
                         st.st_ctime_ns))
    return tuple(sorted(rows))


def adapter_digest(folder: Path, settings: Mapping[str, Any],
                   digests: FileDigestCache | None = None) -> str:
    """sha256 over the adapter folder's content (its weights digest: every file's relative
    path, size and bytes, :mod:`kvpersist.identity.weights_digest`) and the engine's LoRA
    ``settings`` that change the adapter's computation."""
    h = hashlib.sha256()
    h.update(json.dumps([_DOMAIN, dict(settings)], sort_keys=True, default=str).encode())
    h.update(weights_digest(folder, digests if digests is not None else FileDigestCache(None))
             .encode("ascii"))
    return h.hexdigest()


@dataclass
class _Adapter:
    digest: str
    signature: tuple[tuple[str, int, int, int], ...]
    changed: bool = False


_Ident = tuple[int, str, str]


class RequestKeys:
    """The salts of one engine's requests (see module invariants); lives in the scheduler."""

    def __init__(self, lora_settings: Mapping[str, Any] | None,
                 on_keyed: Callable[[str, str, str], None] | None = None,
                 digests: FileDigestCache | None = None,
                 inline_bytes: int = INLINE_DIGEST_BYTES,
                 mm_bidirectional: bool = False) -> None:
        """``on_keyed(digest, name, folder)`` runs once per adapter this engine keys.
        ``digests`` remembers file digests across restarts (none: every start reads the
        adapters); an adapter larger than ``inline_bytes`` is digested on a thread of its own.
        ``mm_bidirectional``: the model attends bidirectionally over multimodal items (vLLM's
        ``is_mm_prefix_lm``), so a chunk's KV can depend on tokens after it: requests with
        items are not cached."""
        self._mm_bidirectional = mm_bidirectional
        self._lora_settings = dict(lora_settings or {})
        self._on_keyed = on_keyed
        self._digests = digests
        self._inline_bytes = inline_bytes
        self._adapters: dict[_Ident, _Adapter] = {}
        self._pending: dict[_Ident, Future[str]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._by_id: dict[int, _Ident] = {}
        self._void_ids: dict[int, str] = {}
        self._logged: set[tuple[_Ident, str]] = set()
        #: Called with an adapter id whose earlier requests must store nothing more.
        self.on_adapter_void: Callable[[int], None] | None = None

    def salt(self, request: Any) -> str | Uncacheable:
        """The salt LMCache must key ``request`` with, or why it cannot be cached."""
        key = self.key(request)
        return key if isinstance(key, Uncacheable) else key.salt

    def key(self, request: Any) -> RequestKey | Uncacheable:
        """The salt and item digests LMCache must key ``request`` with, or why it cannot be
        cached."""
        if getattr(request, "prompt_embeds", None) is not None:
            return Uncacheable("prompt_embeds", "a request with prompt embeddings has no "
                               "content key; it is neither looked up nor stored")
        user_salt = getattr(request, "cache_salt", None) or ""
        features = getattr(request, "mm_features", None)
        items: list[str] | None = None
        if features:
            if self._mm_bidirectional:
                return Uncacheable("mm_bidirectional", "the model attends bidirectionally over "
                                   "multimodal items: a chunk's KV depends on tokens after it, "
                                   "so requests with items are neither looked up nor stored")
            found = mm_item_digests(features)
            if isinstance(found, Uncacheable):
                return found
            items = found
        content = mm_content_digest(features, items)
        assert not isinstance(content, Uncacheable)
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return RequestKey(request_salt(user_salt, None, content), items)
        digest = self.adapter_digest(lora)
        if isinstance(digest, Uncacheable):
            return digest
        return RequestKey(request_salt(user_salt, digest, content), items)

    def _void(self, ident: _Ident, reason: str) -> None:
        """Adapter id ``ident[0]`` may now run other weights than any digest says: its
        requests are not cached from now on, and those keyed before store nothing more."""
        if ident[0] not in self._void_ids:
            self._void_ids[ident[0]] = reason
            if self.on_adapter_void is not None:
                self.on_adapter_void(ident[0])

    def adapter_digest(self, lora: Any) -> str | Uncacheable:
        """The content digest of ``lora`` (vLLM's ``LoRARequest``), taken once per process."""
        ident = (int(getattr(lora, "lora_int_id", 0)), str(getattr(lora, "lora_name", "")),
                 str(getattr(lora, "lora_path", "") or ""))
        if self._by_id.setdefault(ident[0], ident) != ident:
            # vLLM's workers cache an adapter by its id: the second folder may never be loaded
            self._void(ident, "lora_id_reused")
        if getattr(lora, "load_inplace", False):
            self._void(ident, "lora_reloaded")
        void = self._void_ids.get(ident[0])
        if void is not None:
            return self._uncacheable(ident, void, VOID_DETAILS[void].format(name=ident[1],
                                                                            id=ident[0]))
        folder = Path(ident[2])
        if not ident[2] or not folder.is_dir():
            return self._uncacheable(ident, "lora_not_local",
                                     f"LoRA adapter {ident[1]!r} is not a local folder "
                                     f"({ident[2]!r}); its requests are not cached")
        try:
            signature = folder_signature(folder)
            known = self._adapters.get(ident)
            if known is None:
                digest = self._digest_of(ident, folder, signature)
                if digest is None:
                    return Uncacheable("lora_digest_pending", f"LoRA adapter {ident[1]!r} is "
                                       "being digested off the scheduler's thread")
                known = self._adapters[ident] = _Adapter(digest, signature)
                logger.info("kvpersist: LoRA adapter %r (%s) keyed by content digest %s",
                            ident[1], folder, known.digest)
                if self._on_keyed is not None:
                    self._on_keyed(known.digest, ident[1], str(folder))
            elif known.signature != signature:
                known.changed = True
        except OSError as exc:
            return self._uncacheable(ident, "lora_unreadable",
                                     f"LoRA adapter {ident[1]!r} cannot be read: {exc}")
        if known.changed:
            return self._uncacheable(ident, "lora_changed",
                                     f"LoRA adapter {ident[1]!r} changed on disk after this "
                                     "engine keyed it; its requests are not cached until the "
                                     "engine restarts")
        return known.digest

    def _digest_of(self, ident: _Ident, folder: Path,
                   signature: tuple[tuple[str, int, int, int], ...]) -> str | None:
        """The adapter's digest now (a small adapter, or one whose files' digests are all
        cached), or None while a thread computes it (a large one: the scheduler's thread never
        reads it).  Raises OSError as reading does."""
        pending = self._pending.get(ident)
        if pending is None:
            if (sum(row[1] for row in signature) <= self._inline_bytes
                    or (self._digests is not None and self._digests.knows(folder))):
                return adapter_digest(folder, self._lora_settings, self._digests)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvp-lora-digest")
            self._pending[ident] = self._pool.submit(adapter_digest, folder,
                                                     self._lora_settings, self._digests)
            return None
        if not pending.done():
            return None
        del self._pending[ident]
        digest = pending.result()  # OSError propagates as from an inline digest
        if folder_signature(folder) != signature:
            raise OSError("the adapter's files changed while they were digested")
        return digest

    def _uncacheable(self, ident: _Ident, reason: str, detail: str) -> Uncacheable:
        if (ident, reason) not in self._logged:
            self._logged.add((ident, reason))
            logger.warning("kvpersist: %s", detail)
        return Uncacheable(reason, detail)


def lora_settings(vllm_config: Any) -> dict[str, Any]:
    """The engine's LoRA settings that change an adapter's computation: the ``lora_config``
    fields the classification marks per-request (:mod:`kvpersist.identity.engine_fields`)."""
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        return {}
    out: dict[str, Any] = {}
    for name, decision in ENGINE_FIELDS.items():
        top, _, field = name.partition(".")
        if top == "lora_config" and isinstance(decision, PerRequest):
            out[field] = str(getattr(lora_config, field, None))
    return out
