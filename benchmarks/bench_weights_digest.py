"""What the weights digest costs at start: a multi-GB checkpoint digested cold (page cache
dropped), then again from the per-file-version cache, beside a cold raw read of the same files.

    .venv/bin/python benchmarks/bench_weights_digest.py --gib 4 --shards 4 --work /tmp/wdigest

Prints the three times, their ratios, and writes ``--json``.  Root is needed to drop the page
cache (otherwise the "cold" figures are warm, and the output says so).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvpersist.admin.page_cache import drop_page_cache
from kvpersist.identity.weights_digest import FileDigestCache, weights_digest

_BLOCK = 8 << 20


def make_checkpoint(folder: Path, gib: float, shards: int) -> None:
    """``shards`` files of random bytes totalling ``gib`` GiB, plus a config.json (kept when
    they already exist with the right sizes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    size = int(gib * (1 << 30)) // shards
    for i in range(shards):
        path = folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        if path.is_file() and path.stat().st_size == size:
            continue
        with path.open("wb") as out:
            left = size
            while left:
                block = os.urandom(min(_BLOCK, left))
                out.write(block)
                left -= len(block)


def cold(drop: bool) -> None:
    if drop:
        drop_page_cache()


def raw_read(folder: Path) -> float:
    began = time.perf_counter()
    for path in sorted(folder.iterdir()):
        with path.open("rb") as data:
            while data.read(_BLOCK):
                pass
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="checkpoint size (default 4)")
    parser.add_argument("--shards", type=int, default=4, help="weight files (default 4)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvp-weights-digest"),
                        help="where the checkpoint and the digest cache go")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    folder = args.work / "model"
    make_checkpoint(folder, args.gib, args.shards)
    can_drop = os.geteuid() == 0
    cache = FileDigestCache(args.work / "digests")
    for entry in (args.work / "digests").glob("*"):
        entry.unlink()
    cold(can_drop)
    raw_s = raw_read(folder)
    cold(can_drop)
    began = time.perf_counter()
    digest = weights_digest(folder, cache)
    first_s = time.perf_counter() - began
    cold(can_drop)
    began = time.perf_counter()
    again = weights_digest(folder, cache)
    cached_s = time.perf_counter() - began
    assert again == digest
    total = sum(p.stat().st_size for p in folder.iterdir())
    result = {"bytes": total, "files": len(list(folder.iterdir())), "page_cache_dropped": can_drop,
              "raw_cold_read_s": raw_s, "first_digest_s": first_s, "cached_digest_s": cached_s,
              "first_over_raw_read": first_s / raw_s, "digest": digest}
    print(f"{total / (1 << 30):.2f} GiB in {result['files']} files"
          f"{'' if can_drop else ' (page cache NOT dropped: not root)'}")
    print(f"cold raw read       {raw_s:8.2f} s  ({total / raw_s / (1 << 20):,.0f} MiB/s)")
    print(f"first digest        {first_s:8.2f} s  ({first_s / raw_s:.2f}x the raw read)")
    print(f"cached digest       {cached_s * 1000:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
