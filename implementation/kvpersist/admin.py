"""What ``kvp-admin report | cleanup | quota | verify | metrics`` compute (CLI-free, testable).

Invariants
----------
* Every figure comes from the disk (:mod:`kvpersist.inventory`); the server is asked only which
  namespaces are active and, while it runs, to delete live files so its index stays right.
* ``apply_cleanup`` deletes only planned files that are still regular files (not symlinks) of the
  planned class directly inside the root tree; a path that resolves outside the root is refused.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .budget import BudgetModel, over_quota
from .inventory import CacheFile, Inventory, classify
from .l2_store import quarantine_file, verify_file
from .retention import CleanupPlan

_NS_IN_TEXT = re.compile(r"kvp-[0-9a-f]{32}")


def active_namespaces_from_server(http_url: str, timeout: float = 5.0) -> set[str] | None:
    """Namespaces of the engines registered with the running server, or None if it is down."""
    try:
        with urllib.request.urlopen(http_url + "/status", timeout=timeout) as resp:
            body = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    meta = {k: body.get(k) for k in ("cache_context_meta", "non_cuda_context_meta",
                                     "registered_non_cuda_instance_ids")}
    return set(_NS_IN_TEXT.findall(json.dumps(meta)))


# --------------------------------------------------------------------------- report


def build_report(inv: Inventory, budget: BudgetModel, quotas: dict[str, int],
                 active: set[str]) -> dict[str, Any]:
    usage = inv.namespaces()
    over = over_quota({ns: u.bytes for ns, u in usage.items()}, quotas)
    rows = []
    for ns in sorted(usage, key=lambda n: -usage[n].bytes):
        u = usage[ns]
        rows.append({
            "namespace": ns,
            "model_ids": sorted(u.model_ids),
            "files": u.files,
            "bytes": u.bytes,
            "budget_share": budget.share(u.bytes),
            "last_access": u.last_access,
            "state": "active" if ns in active else "stale",
            "quota_bytes": quotas.get(ns),
            "over_quota_bytes": over.get(ns, 0),
        })
    classes = {c: {"files": n, "bytes": b} for c, (n, b) in inv.by_class().items()}
    return {
        "root": str(inv.root),
        "budget_bytes": budget.cap_bytes,
        "trigger_bytes": budget.trigger_bytes,
        "reclaim_target_bytes": budget.reclaim_target_bytes,
        "cache_bytes": inv.cache_bytes,
        "budget_share": budget.share(inv.cache_bytes),
        "namespaces": rows,
        "classes": classes,
        "active_namespaces": sorted(active),
        "scan_seconds": round(inv.seconds, 3),
        "errors": inv.errors,
    }


# --------------------------------------------------------------------------- cleanup


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


def safe_to_delete(root: Path, f: CacheFile, dir_cache: dict[str, str | None] | None = None
                   ) -> str | None:
    """None if ``f`` may be deleted now, else the reason it may not.  ``dir_cache`` remembers the
    verdict on each directory across calls (one cleanup), so a million files cost one lstat each."""
    if "/" in f.name or f.name in ("", ".", ".."):
        return "outside the cache root"
    verdicts = {} if dir_cache is None else dir_cache
    if f.dir not in verdicts:
        verdicts[f.dir] = _dir_refusal(root, f.dir)
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
    req = urllib.request.Request(http_url + "/cache/objects", method="DELETE",
                                 data=json.dumps({"keys": keys, "tier": "all"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


def apply_cleanup(plan: CleanupPlan, root: Path, *, server_url: str | None,
                  batch: int = 256, timeout: float = 30.0,
                  progress: Callable[[int], None] | None = None) -> CleanupResult:
    """Delete the planned files.  While a server runs (``server_url``), live files go through
    its ``DELETE /cache/objects`` so its index and byte count stay right; files it did not know
    are then removed directly."""
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


# --------------------------------------------------------------------------- verify


@dataclass
class VerifyResult:
    checked: int = 0
    bytes_read: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    quarantined: int = 0
    seconds: float = 0.0


def verify_files(root: Path, files: Iterable[CacheFile], *, quarantine: bool,
                 max_bytes_per_s: float | None = None,
                 progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Scrub every kvpersist ``.kvp`` live file; optionally quarantine the failures."""
    result = VerifyResult()
    began = time.monotonic()
    for f in files:
        if f.cls != "live" or f.path.suffix != ".kvp":
            continue
        reason, nbytes = verify_file(f.path)
        result.checked += 1
        result.bytes_read += nbytes
        if reason is not None:
            result.failures.append((str(f.path), reason))
            if quarantine:
                try:
                    quarantine_file(root, f.path, reason)
                    result.quarantined += 1
                except OSError:
                    pass
        if max_bytes_per_s:
            ahead = result.bytes_read / max_bytes_per_s - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)
        if progress is not None:
            progress(result.checked)
    result.seconds = time.monotonic() - began
    return result


# --------------------------------------------------------------------------- metrics


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(report: dict[str, Any]) -> str:
    """Prometheus text exposition of a report (bytes and files per namespace, classes, budget)."""
    lines = [
        "# HELP kvpersist_budget_bytes Hard cap of the L2 tier (KVP_CACHE_BUDGET_GB).",
        "# TYPE kvpersist_budget_bytes gauge",
        f"kvpersist_budget_bytes {report['budget_bytes']}",
        "# HELP kvpersist_cache_bytes Bytes of KV files under the root (live, temp, quarantine).",
        "# TYPE kvpersist_cache_bytes gauge",
        f"kvpersist_cache_bytes {report['cache_bytes']}",
        "# HELP kvpersist_budget_share Share of the budget used by the cache.",
        "# TYPE kvpersist_budget_share gauge",
        f"kvpersist_budget_share {report['budget_share']:.6f}",
        "# HELP kvpersist_namespace_bytes Bytes of live KV files per namespace.",
        "# TYPE kvpersist_namespace_bytes gauge",
    ]
    for row in report["namespaces"]:
        labels = (f'namespace="{_label(row["namespace"])}",'
                  f'model_id="{_label(",".join(row["model_ids"]))}",state="{row["state"]}"')
        lines.append(f"kvpersist_namespace_bytes{{{labels}}} {row['bytes']}")
    lines += ["# HELP kvpersist_namespace_files Live KV files per namespace.",
              "# TYPE kvpersist_namespace_files gauge"]
    for row in report["namespaces"]:
        lines.append(f'kvpersist_namespace_files{{namespace="{_label(row["namespace"])}"}} '
                     f"{row['files']}")
    lines += ["# HELP kvpersist_class_bytes Bytes per file class under the root.",
              "# TYPE kvpersist_class_bytes gauge"]
    for cls, v in report["classes"].items():
        lines.append(f'kvpersist_class_bytes{{class="{cls}"}} {v["bytes"]}')
    lines += ["# HELP kvpersist_class_files Files per class under the root.",
              "# TYPE kvpersist_class_files gauge"]
    for cls, v in report["classes"].items():
        lines.append(f'kvpersist_class_files{{class="{cls}"}} {v["files"]}')
    lines += ["# HELP kvpersist_quarantine_files Files in quarantine.",
              "# TYPE kvpersist_quarantine_files gauge",
              f"kvpersist_quarantine_files {report['classes']['quarantine']['files']}"]
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Atomic write for node_exporter's textfile collector."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
