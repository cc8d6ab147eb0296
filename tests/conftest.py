from __future__ import annotations

import sys
from pathlib import Path

# Tests run against the source tree even where the package is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementation"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs mounted for the test (ENOSPC comes fast); skipped where mounting is not
    permitted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
