"""A shared tree as a whole, seen from any node: its nodes' parts, which of them a live server
holds, their usage against their shares, and the namespaces no cleanup may touch.

Invariants
----------
* Read-only: nothing here changes a file.
* A part is *live* while a server holds its root lock (``flock``, which GlusterFS, CephFS,
  Lustre and NFSv4 carry across mounts): the holder (``pid@host``) is reported, not a pid file,
  because another node's pid means nothing here.
* The protected namespaces of a tree are those with an identity record in a live part: a
  namespace a live node served may be read by any node from any part, so a cleanup anywhere
  treats it as active (a miss is acceptable, a deleted hot prefix on a live node is not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.server import NODES_DIR_NAME, node_part_names
from ..identity.records import list_records
from ..l2.inventory import InventoryError, build_inventory
from ..l2.lock import root_lock_holder


@dataclass(frozen=True)
class NodePart:
    node_id: str
    root: Path
    holder: str | None  # pid@host of the server holding it, None when no server does
    files: int  # live KV files
    bytes: int  # every KV file's bytes (live, temp, quarantine): what counts against the share
    namespaces: tuple[str, ...]  # with an identity record in this part
    error: str | None = None

    @property
    def live(self) -> bool:
        return self.holder is not None


def part_names(tree: Path) -> list[str]:
    """The node ids with a part in ``tree``, sorted; InventoryError when it cannot be listed."""
    try:
        return node_part_names(tree)
    except OSError as exc:
        raise InventoryError(f"{tree / NODES_DIR_NAME} cannot be listed ({exc.strerror}); is "
                             f"{tree} a shared tree (KVP_NODE_ID set on its nodes)?") from None


def live_recorded_namespaces(tree: Path) -> set[str]:
    """The protected namespaces of ``tree`` (module invariants) from lock probes and records
    alone, without inventorying any part: what a cleanup needs, at any tree size.
    InventoryError when the parts cannot be listed (then nothing is known)."""
    nodes_dir = tree / NODES_DIR_NAME
    return {ns for name in part_names(tree) if root_lock_holder(nodes_dir / name) is not None
            for ns in list_records(nodes_dir / name)}


def node_parts(tree: Path) -> list[NodePart]:
    """Every node's part of ``tree`` (sorted by node id); an unreadable part carries its error."""
    nodes_dir = tree / NODES_DIR_NAME
    parts = []
    for name in part_names(tree):
        root = nodes_dir / name
        holder = root_lock_holder(root)
        records = tuple(sorted(list_records(root)))
        try:
            inv = build_inventory(root)
            live_files = inv.by_class()["live"][0]
            parts.append(NodePart(name, root, holder, live_files, inv.cache_bytes, records))
        except InventoryError as exc:
            parts.append(NodePart(name, root, holder, 0, 0, records, str(exc)))
    return parts


def protected_namespaces(parts: list[NodePart]) -> set[str]:
    """Namespaces recorded in a live part (see module invariants)."""
    return {ns for part in parts if part.live for ns in part.namespaces}


def tree_report(tree: Path, budget_bytes: int, shares: int) -> dict[str, Any]:
    parts = node_parts(tree)
    share = budget_bytes // shares
    total = sum(p.bytes for p in parts)
    return {
        "tree": str(tree), "budget_bytes": budget_bytes, "shares": shares,
        "share_bytes": share, "tree_bytes": total,
        "tree_files": sum(p.files for p in parts),
        "within_budget": total <= budget_bytes,
        "protected_namespaces": sorted(protected_namespaces(parts)),
        "nodes": [{"node_id": p.node_id, "root": str(p.root), "live": p.live,
                   "holder": p.holder, "files": p.files, "bytes": p.bytes,
                   "share_used": p.bytes / share if share else 0.0,
                   "namespaces": list(p.namespaces), "error": p.error} for p in parts],
        "parts_beyond_shares": max(0, len(parts) - shares),
    }
