"""Identity records: which serving configuration each namespace under the cache root stands for.

A namespace is a hash, so the files of ``kvp-3f…`` do not say which model, dtype or parallelism
made them.  Whenever the connector turns caching on, it records the identity it resolved as
``<cache root>/namespaces/<namespace>.json``; ``kvp-admin identity show NS`` and
``identity diff NS B`` read it back ("why no hits?" for what is on disk, not only for configs).

Invariants
----------
* A record is only ever trusted if its fields hash to its own namespace (and file name); any
  other record is reported as invalid, never used.
* Written atomically (temp file + rename) and only rewritten when its content changes.
* Metadata only: caching never depends on a record; a record that cannot be written is a
  warning, never an error; ``kvp-admin cleanup`` never deletes records (they are not cache
  files and stay a few hundred bytes each).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..atomic import write_record_text
from .fields import NAMESPACE_RE, CacheIdentity, IdentityError

RECORDS_DIR = "namespaces"
RECORD_VERSION = 1


def record_path(root: str | Path, namespace: str) -> Path:
    if not NAMESPACE_RE.fullmatch(namespace):
        raise IdentityError("namespace", f"{namespace!r} is not kvp- followed by 32 hex digits")
    return Path(root) / RECORDS_DIR / f"{namespace}.json"


def record_body(identity: CacheIdentity) -> str:
    return json.dumps({"version": RECORD_VERSION, "namespace": identity.namespace,
                       "lmcache_model_name": identity.lmcache_model_name(),
                       "fields": identity.as_dict()}, indent=2, sort_keys=True) + "\n"


def write_record(root: str | Path, identity: CacheIdentity) -> Path:
    """Record ``identity`` under ``root`` (which must exist); returns the record's path."""
    return write_record_text(record_path(root, identity.namespace), record_body(identity))


def read_record(root: str | Path, namespace: str) -> CacheIdentity:
    """The identity recorded for ``namespace``; IdentityError if there is none or it is invalid."""
    path = record_path(root, namespace)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IdentityError("namespace", f"no identity record for {namespace} under "
                            f"{path.parent} (written when a vLLM engine with that identity "
                            "starts with the kvpersist connector)") from None
    except (OSError, ValueError) as exc:
        raise IdentityError("namespace", f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
        raise IdentityError("namespace", f"{path} is not an identity record")
    identity = CacheIdentity.from_mapping(data["fields"])
    if identity.namespace != namespace:
        raise IdentityError("namespace", f"{path} is invalid: its fields hash to "
                            f"{identity.namespace}, not {namespace}")
    return identity


def list_records(root: str | Path) -> dict[str, CacheIdentity | str]:
    """Namespace → its recorded identity, or the reason its record is unusable."""
    out: dict[str, CacheIdentity | str] = {}
    try:
        names = sorted(os.listdir(Path(root) / RECORDS_DIR))
    except OSError:
        return out
    for name in names:
        ns = name.removesuffix(".json")
        if not name.endswith(".json") or not NAMESPACE_RE.fullmatch(ns):
            continue
        try:
            out[ns] = read_record(root, ns)
        except IdentityError as exc:
            out[ns] = str(exc)
    return out
