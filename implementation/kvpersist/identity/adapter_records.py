"""LoRA adapter records: which adapter each derived salt under the cache root stands for.

A request with a LoRA adapter is keyed under a salt derived from the adapter's content digest
(``kvpk-lora<tag>-…``, :mod:`kvpersist.serving.connector.request_keys`), so a file name says only the
first 12 hex digits of that digest.  When an engine first keys an adapter, it records it as
``<cache root>/adapters/<tag>.json`` (the full digest, the names and folders it was served
under), and ``kvp-admin report`` names the adapters whose files each namespace holds.

Invariants
----------
* Metadata only: caching never depends on a record, a record that cannot be written is a
  warning, and ``kvp-admin cleanup`` never deletes one.
* A record is read only if its tag is the first 12 hex digits of its digest; names and folders
  accumulate (one adapter content served under several names is one record).
* Written atomically, and only rewritten when its content changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..atomic import write_record_text

ADAPTERS_DIR = "adapters"
TAG_LEN = 12
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def record_adapter(root: str | Path, digest: str, name: str, folder: str) -> Path:
    """Record that adapter content ``digest`` was served as ``name`` from ``folder``."""
    if not _DIGEST_RE.match(digest):
        raise ValueError(f"adapter digest {digest!r} is not 64 hex digits")
    path = Path(root) / ADAPTERS_DIR / f"{digest[:TAG_LEN]}.json"
    known = read_adapter(path) or {"digest": digest, "names": [], "folders": []}
    names = sorted({*known["names"], name})
    folders = sorted({*known["folders"], folder})
    return write_record_text(path, json.dumps(
        {"tag": digest[:TAG_LEN], "digest": digest, "names": names, "folders": folders},
        indent=2, sort_keys=True) + "\n")


def read_adapter(path: Path) -> dict[str, Any] | None:
    """A record's content, or None when it is missing or not a valid record."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if (not isinstance(data, dict) or not _DIGEST_RE.match(str(data.get("digest", "")))
            or data.get("tag") != str(data["digest"])[:TAG_LEN]
            or not isinstance(data.get("names"), list)
            or not isinstance(data.get("folders"), list)):
        return None
    return data


def adapter_names(root: str | Path) -> dict[str, list[str]]:
    """tag -> the names its adapter was served under, for every valid record under ``root``."""
    out: dict[str, list[str]] = {}
    folder = Path(root) / ADAPTERS_DIR
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        data = read_adapter(path)
        if data is not None:
            out[str(data["tag"])] = [str(n) for n in data["names"]]
    return out
