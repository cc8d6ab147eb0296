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

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.server import NODES_DIR_NAME, node_part_names
from ..identity.records import list_records
from ..l2.inventory import InventoryError, build_inventory
from ..l2.lock import root_lock_holder


@dataclass(frozen=True)
class PartState:
    """What a node's part says without walking it: who holds it, which namespaces it records."""

    node_id: str
    root: Path
    holder: str | None  # pid@host of the server holding it, None when no server does
    namespaces: tuple[str, ...]  # with an identity record in this part

    @property
    def live(self) -> bool:
        return self.holder is not None


@dataclass(frozen=True)
class NodePart:
    state: PartState
    files: int  # live KV files
    bytes: int  # every KV file's bytes (live, temp, quarantine): what counts against the share
    error: str | None = None


def part_states(tree: Path) -> list[PartState]:
    """Every node's part of ``tree``, sorted by node id (a lock probe and the identity records
    each; no walk)."""
    try:
        names = node_part_names(tree)
    except OSError as exc:
        raise InventoryError(f"{tree / NODES_DIR_NAME} cannot be listed ({exc.strerror}); is "
                             f"{tree} a shared tree (KVP_NODE_ID set on its nodes)?") from None
    roots = [(name, tree / NODES_DIR_NAME / name) for name in names]
    return [PartState(name, root, root_lock_holder(root), tuple(sorted(list_records(root))))
            for name, root in roots]


def node_parts(tree: Path) -> list[NodePart]:
    """:func:`part_states` with each part's files and bytes from the disk; an unreadable part
    carries its error."""
    parts = []
    for state in part_states(tree):
        try:
            inv = build_inventory(state.root)
            parts.append(NodePart(state, inv.by_class()["live"][0], inv.cache_bytes))
        except InventoryError as exc:
            parts.append(NodePart(state, 0, 0, str(exc)))
    return parts


def protected_namespaces(states: Iterable[PartState]) -> set[str]:
    """Namespaces recorded in a live part (see module invariants)."""
    return {ns for state in states if state.live for ns in state.namespaces}


def tree_report(tree: Path, budget_bytes: int, shares: int) -> dict[str, Any]:
    parts = node_parts(tree)
    share = budget_bytes // shares
    total = sum(p.bytes for p in parts)
    return {
        "tree": str(tree), "budget_bytes": budget_bytes, "shares": shares,
        "share_bytes": share, "tree_bytes": total,
        "tree_files": sum(p.files for p in parts),
        "within_budget": total <= budget_bytes,
        "protected_namespaces": sorted(protected_namespaces(p.state for p in parts)),
        "nodes": [{"node_id": p.state.node_id, "root": str(p.state.root), "live": p.state.live,
                   "holder": p.state.holder, "files": p.files, "bytes": p.bytes,
                   "share_used": p.bytes / share if share else 0.0,
                   "namespaces": list(p.state.namespaces), "error": p.error} for p in parts],
        "parts_beyond_shares": max(0, len(parts) - shares),
    }
