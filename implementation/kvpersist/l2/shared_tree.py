"""The other nodes' parts of a shared tree, for the keys this node's index does not hold.

Layout: every node writes only below ``<tree>/nodes/<its id>/`` (its own :class:`KvFileStore`,
lock, scan, accounting and eviction, unchanged), and finds any node's file at the same relative
path under that node's part.  A key is looked up in this node's index first (no file-system
operation); only on a miss are the other parts asked.

Invariants
----------
* Read-only: nothing here creates, moves or deletes a file in another node's part.  A file that
  fails verification there is a miss for this node, never quarantined by it (its owner may be
  replacing it; the owner's own read or ``kvp-admin verify`` deals with a bad file).
* File-system operations per lookup, counted in :meth:`SharedTree.status`: a key found before
  (positive cache) costs none here, the read's ``open`` tells whether it is still there; a key
  missed less than ``negative_ttl_s`` ago costs none; any other key costs one ``stat`` per other
  node until found (at most N-1), plus one listing of ``<tree>/nodes`` every ``nodes_ttl_s``.
* A file another node publishes is seen within ``negative_ttl_s`` (plus the mount's own
  attribute and entry caching, which preflight reports).
* Both caches hold at most ``max_entries`` keys each (least recently used out first).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.server import NODES_DIR_NAME, node_part_names
from .layout import KeyFields

Clock = Callable[[], float]


class SharedTree:
    """Finds keys in the parts of the other nodes of ``tree`` (see module invariants)."""

    def __init__(self, tree: Path, own_part: Path, relative: Callable[[KeyFields], tuple[str, ...]],
                 *, negative_ttl_s: float = 2.0, nodes_ttl_s: float = 5.0,
                 max_entries: int = 65536, clock: Clock = time.monotonic) -> None:
        self.tree = tree
        self.own_part = own_part
        self._relative = relative
        self.negative_ttl_s = negative_ttl_s
        self.nodes_ttl_s = nodes_ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._found: OrderedDict[KeyFields, Path] = OrderedDict()
        self._missed: OrderedDict[KeyFields, float] = OrderedDict()  # key → expiry
        self._nodes: list[Path] = []
        self._nodes_at = float("-inf")
        self._counts = {"lookups": 0, "fs_ops": 0, "found": 0, "cached_found": 0,
                        "cached_missed": 0, "missed": 0, "forgotten": 0}

    def other_parts(self) -> list[Path]:
        """The other nodes' parts, re-listed every ``nodes_ttl_s`` (a node that joins is seen)."""
        with self._lock:
            if self._clock() - self._nodes_at <= self.nodes_ttl_s:
                return list(self._nodes)
        try:
            parts = [path for name in node_part_names(self.tree)
                     if (path := self.tree / NODES_DIR_NAME / name) != self.own_part]
        except OSError:
            parts = []  # the tree is unreachable: every key is a miss until it is back
        with self._lock:
            self._nodes, self._nodes_at = parts, self._clock()
            self._counts["fs_ops"] += 1
        return parts

    def find(self, key: KeyFields) -> Path | None:
        """The path of ``key``'s file in another node's part, or None."""
        now = self._clock()
        with self._lock:
            self._counts["lookups"] += 1
            path = self._found.get(key)
            if path is not None:
                self._found.move_to_end(key)
                self._counts["cached_found"] += 1
                return path
            expiry = self._missed.get(key)
            if expiry is not None and expiry > now:
                self._counts["cached_missed"] += 1
                return None
        relative = self._relative(key)
        stats = 0
        found: Path | None = None
        for part in self.other_parts():
            candidate = part.joinpath(*relative)
            stats += 1
            try:
                if stat.S_ISREG(os.stat(candidate, follow_symlinks=False).st_mode):
                    found = candidate
                    break
            except OSError:
                continue  # absent, or that node's brick is unreachable: not there for us
        with self._lock:
            self._counts["fs_ops"] += stats
            if found is not None:
                self._counts["found"] += 1
                self._missed.pop(key, None)
                self._remember(self._found, key, found)
            else:
                self._counts["missed"] += 1
                self._remember(self._missed, key, now + self.negative_ttl_s)
        return found

    def forget(self, key: KeyFields) -> None:
        """The file found for ``key`` could not be read or verified: look again next time."""
        with self._lock:
            if self._found.pop(key, None) is not None:
                self._counts["forgotten"] += 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"tree": str(self.tree), "other_nodes": len(self._nodes),
                    "negative_ttl_s": self.negative_ttl_s, **self._counts}

    def _remember(self, table: OrderedDict[KeyFields, Any], key: KeyFields, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)
