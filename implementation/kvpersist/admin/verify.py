"""``kvp-admin verify``: scrub every kvpersist file's header and checksum, at a bounded rate.

Invariants
----------
* Read-only unless ``quarantine`` is set; then only files that fail are moved, into
  ``quarantine/`` of the same root.
* A file gone when its scrub reads it (evicted or cleaned up by a live server after the
  listing) is counted ``vanished``, never a failure: it serves nothing wrong, as ``cleanup``
  counts such files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..l2.files import quarantine_file, verify_file
from ..l2.inventory import CacheFile, root_of
from .rank_coverage import global_rank_of, world_size_of


@dataclass
class VerifyResult:
    checked: int = 0
    bytes_read: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    quarantined: int = 0
    vanished: int = 0
    seconds: float = 0.0
    #: "rank/world size" -> {"checked": files, "failed": files}
    per_rank: dict[str, dict[str, int]] = field(default_factory=dict)

    def _count(self, f: CacheFile, failed: bool) -> None:
        key = f.key
        label = "?" if key is None else \
            f"{global_rank_of(key.kv_rank)}/{world_size_of(key.kv_rank)}"
        row = self.per_rank.setdefault(label, {"checked": 0, "failed": 0})
        row["checked"] += 1
        row["failed"] += int(failed)


def verify_files(root: Path | Sequence[Path], files: Iterable[CacheFile], *, quarantine: bool,
                 max_bytes_per_s: float | None = None,
                 progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Scrub every kvpersist ``.kvp`` live file; optionally quarantine the failures (into the
    quarantine of the root, among ``root``, that holds the file)."""
    roots = [root] if isinstance(root, Path) else list(root)
    result = VerifyResult()
    began = time.monotonic()
    for f in files:
        if f.cls != "live" or f.path.suffix != ".kvp":
            continue
        reason, nbytes = verify_file(f.path)
        if reason is not None and not os.path.lexists(f.path):
            result.vanished += 1
            continue
        result.checked += 1
        result.bytes_read += nbytes
        result._count(f, reason is not None)
        if reason is not None:
            result.failures.append((str(f.path), reason))
            if quarantine:
                holder = root_of(f.dir, roots)
                try:
                    if holder is not None:
                        quarantine_file(holder, f.path, reason)
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
