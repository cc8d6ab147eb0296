"""``kvp-admin cleanup --apply``: delete what a retention plan names, and nothing else.

Invariant: only planned files that are still regular files (not symlinks) of the planned class
inside the root tree are deleted; a path that resolves outside the root, or is reached through a
symlinked directory, is refused.  While a server runs, live files are deleted through its
``DELETE /cache/objects`` so that its index and byte count stay right.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..l2.inventory import CacheFile, classify, root_of
from ..serving import http
from .retention import CleanupPlan


@dataclass
class CleanupResult:
    deleted_files: int = 0
    deleted_bytes: int = 0
    via_server: int = 0
    refused: list[str] = field(default_factory=list)
    vanished: int = 0


def _dir_refusal(root: Path, directory: str) -> str | None:
    """None if ``directory`` lies under ``root`` and no component between them is a symlink."""
    path = Path(directory)
    if ".." in path.parts:
        return "outside the cache root"
    try:
        path.resolve(strict=False).relative_to(root.resolve())
    except ValueError:
        return "outside the cache root"
    if any(p.is_symlink() for p in (path, *path.parents) if p.is_relative_to(root)):
        return "reached through a symlink"
    return None


def safe_to_delete(root: Path | Sequence[Path], f: CacheFile,
                   dir_cache: dict[str, str | None] | None = None) -> str | None:
    """None if ``f`` may be deleted now, else the reason it may not.  ``dir_cache`` remembers the
    verdict on each directory across calls (one cleanup), so a million files cost one lstat each."""
    if "/" in f.name or f.name in ("", ".", ".."):
        return "outside the cache root"
    verdicts = {} if dir_cache is None else dir_cache
    if f.dir not in verdicts:
        holder = root_of(f.dir, [root] if isinstance(root, Path) else root)
        verdicts[f.dir] = ("outside the cache root" if holder is None
                           else _dir_refusal(holder, f.dir))
    if verdicts[f.dir] is not None:
        return verdicts[f.dir]
    try:
        st = os.lstat(f.fspath)
    except FileNotFoundError:
        return "vanished"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    cls, _ = classify(f.name, f.cls == "quarantine")
    if cls != f.cls:
        return f"changed class ({cls})"
    return None


def _delete_via_server(http_url: str, files: list[CacheFile], timeout: float) -> None:
    keys = []
    for f in files:
        key = f.key
        assert key is not None
        keys.append({"chunk_hash_hex": key.chunk_hash.hex(), "model_name": key.model_name,
                     "kv_rank": key.kv_rank, "object_group_id": key.object_group_id,
                     "cache_salt": key.cache_salt})
    resp = http.request("DELETE", http_url + "/cache/objects",
                        payload={"keys": keys, "tier": "all"}, timeout=timeout)
    if not resp.ok:
        raise http.HttpError(f"DELETE {http_url}/cache/objects answered {resp.status}: "
                             f"{resp.body[:200]!r}")


def apply_cleanup(plan: CleanupPlan, root: Path | Sequence[Path], *, server_url: str | None,
                  batch: int = 256, timeout: float = 30.0,
                  progress: Callable[[int], None] | None = None) -> CleanupResult:
    """Delete the planned files, each under one of the tier's roots (``root``: one or all).
    While a server runs (``server_url``), live files go through its ``DELETE /cache/objects``
    so its index and byte count stay right; files it did not know are then removed directly."""
    result = CleanupResult()
    deletable: list[CacheFile] = []
    dir_cache: dict[str, str | None] = {}
    for item in plan.items:
        why = safe_to_delete(root, item.file, dir_cache)
        if why == "vanished":
            result.vanished += 1
        elif why is not None:
            result.refused.append(f"{item.file.path}: {why}")
        else:
            deletable.append(item.file)
    if server_url is not None:
        live = [f for f in deletable if f.cls == "live" and f.key is not None]
        for start in range(0, len(live), batch):
            chunk = live[start:start + batch]
            _delete_via_server(server_url, chunk, timeout)
            result.via_server += len(chunk)
    for n, f in enumerate(deletable, 1):
        try:
            os.unlink(f.fspath)
        except FileNotFoundError:
            if server_url is None or f.cls != "live":
                result.vanished += 1
                continue
        result.deleted_files += 1
        result.deleted_bytes += f.size
        if progress is not None:
            progress(n)
    return result
