"""The test suite's own check that it leaves no shared memory behind (``scripts/test.sh``).

``snapshot FILE`` records the shared-memory names present before the run; ``check FILE`` lists
those that appeared since and that no process uses, and exits 1 naming them: Python's
``psm_*`` and ``sem.mp-*``, vLLM's message queues and CPU communicator buffers, LMCache's
``lmcache_kv_*``.  A name a live process still maps or holds open (by name or inode) is not a
leftover (a concurrent run's); anything else is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..serving.shm_sweep import PIDLESS_NAMES, SEGMENT_NAME, SHM_DIR, segments_in_use


def ours(shm_dir: Path = SHM_DIR) -> set[str]:
    """Shared-memory names kvpersist's stack makes (or makes happen) under ``shm_dir``."""
    try:
        return {name for name in os.listdir(shm_dir)
                if SEGMENT_NAME.match(name) or any(p.match(name) for p in PIDLESS_NAMES)}
    except OSError:
        return set()


def leftovers(before: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Names that appeared since ``before`` and that nobody uses."""
    new = ours(shm_dir) - before
    return sorted(new - segments_in_use(shm_dir)) if new else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpersist.testing.shm_leftovers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("snapshot", "check"))
    parser.add_argument("file", type=Path, help="where the snapshot is kept")
    args = parser.parse_args(argv)
    if args.action == "snapshot":
        args.file.write_text(json.dumps(sorted(ours())))
        return 0
    left = leftovers(set(json.loads(args.file.read_text())))
    if left:
        print(f"shared memory left behind by the run ({len(left)}): {', '.join(left)}",
              file=sys.stderr)
        return 1
    print("no shared memory left behind by the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
