"""``kvp-admin report``: per namespace files, bytes, budget share, last access, quota and state.

Invariant: every figure comes from the disk (the inventory); the server is asked only which
namespaces are active.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..identity.adapter_records import adapter_names
from ..l2.inventory import QUARANTINE, Inventory, root_of
from ..l2.layout import split_model_name
from ..serving.connector.request_keys import ADAPTER_SALT
from ..serving.lmcache_compat import status as server_status
from .budget import BudgetModel, over_quota
from .rank_coverage import RankCoverage, rank_coverage


def active_namespaces_from_server(http_url: str, timeout: float = 5.0) -> set[str] | None:
    """Namespaces of the engines registered with the running server, or None if it is down."""
    body = server_status.fetch(http_url, timeout=timeout)
    if body is None:
        return None
    return set(server_status.registered_namespaces(body))


def root_usage(inv: Inventory, roots: Sequence[Path], shares: Sequence[int]
               ) -> list[dict[str, Any]]:
    """Per root (device): the cache files (live, temp, quarantine) and bytes it holds, against
    its share of the budget."""
    of_dir = np.array([-1 if (r := root_of(d, roots)) is None else list(roots).index(r)
                       for d in inv.dirs] + [-1], np.int64)
    cache = inv.cls <= QUARANTINE
    where = of_dir[inv.dir_idx[cache]] if inv.dirs else np.zeros(0, np.int64)
    sizes = inv.size[cache]
    out = []
    for i, (root, share) in enumerate(zip(roots, shares, strict=True)):
        mine = where == i
        used = int(sizes[mine].sum())
        out.append({"root": str(root), "files": int(mine.sum()), "bytes": used,
                    "budget_bytes": int(share), "budget_share": used / share if share else 0.0})
    return out


#: A file name's salt part that a LoRA adapter derived (``@`` then the request keys' format).
_ADAPTER_SALT = re.compile(b"@" + ADAPTER_SALT.pattern.encode("ascii"))


def adapter_usage(inv: Inventory) -> dict[str, dict[str, dict[str, Any]]]:
    """namespace -> adapter tag -> files, bytes and the names the adapter was recorded under,
    for the live files whose salt a LoRA adapter derived (``kvpk-lora<tag>-…``)."""
    names = adapter_names(inv.root)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for match in _ADAPTER_SALT.finditer(inv.names):
        row = int(np.searchsorted(inv.name_end, match.start(), side="right"))
        model = int(inv.model_idx[row])
        if model < 0:
            continue
        ns = split_model_name(inv.model_names[model])[0] or "(no namespace)"
        tag = match.group(1).decode()
        entry = out.setdefault(ns, {}).setdefault(
            tag, {"names": names.get(tag, []), "files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += int(inv.size[row])
    return out


def build_report(inv: Inventory, budget: BudgetModel, quotas: dict[str, int],
                 active: set[str]) -> dict[str, Any]:
    usage = inv.namespaces()
    over = over_quota({ns: u.bytes for ns, u in usage.items()}, quotas)
    coverage = rank_coverage(inv)
    adapters = adapter_usage(inv)
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
            "ranks": coverage.get(ns, RankCoverage()).as_dict(),
            "quota_bytes": quotas.get(ns),
            "over_quota_bytes": over.get(ns, 0),
            "lora_adapters": adapters.get(ns, {}),
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
