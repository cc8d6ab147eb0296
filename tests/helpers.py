"""Shared helpers for tests that run real processes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from kvpersist.identity import load_pins
from kvpersist.settings import REPO_ROOT

TINY_PINS = REPO_ROOT / "configs" / "tiny-llama" / "identity.env"


def l2_files(root: Path, suffixes: tuple[str, ...] = (".bin", ".kvp")) -> dict[str, str]:
    """name → sha256 of content, for every L2 data file directly in ``root``."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.is_file() and p.suffix in suffixes
    }


def wait_for_l2_files(root: Path, min_count: int, timeout: float = 60.0) -> dict[str, str]:
    """Wait until at least ``min_count`` L2 files exist and the set is stable for 1 s."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while time.monotonic() < deadline:
        now = l2_files(root)
        if len(now) >= min_count and now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"expected ≥{min_count} stable L2 files in {root}, have {len(last)}")


def write_pins(path: Path, **changes: str) -> Path:
    """Copy the tiny model's pins to ``path`` with ``changes`` (field name → value)."""
    from kvpersist.identity import FIELDS

    pins = dict(load_pins(TINY_PINS))
    pins.update(changes)
    env_names = {f.name: f.env for f in FIELDS}
    path.write_text("".join(f"{env_names[k]}={v}\n" for k, v in pins.items()))
    return path
