"""The quarantine census behind ``/status`` never waits on the disk, yet stays right."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvpersist.l2.census import QuarantineCensus


def test_get_returns_the_last_count_without_touching_the_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    census = QuarantineCensus(tmp_path, max_age_s=3600)
    assert census.count_now() == (1, 10)

    def no_disk(*args: object, **kwargs: object) -> None:
        raise AssertionError("get() read the directory")

    monkeypatch.setattr(os, "scandir", no_disk)
    (tmp_path / "b").write_bytes(b"y" * 5)
    assert census.get() == (1, 10)  # fresh enough: the cached count, no scandir
    census.added(5)
    assert census.get() == (2, 15)  # our own moves count at once


def test_a_stale_count_is_refreshed_in_the_background(tmp_path: Path) -> None:
    census = QuarantineCensus(tmp_path, max_age_s=0.0)
    census.count_now()
    (tmp_path / "late").write_bytes(b"z" * 7)  # put there by someone else (kvp-admin)
    deadline = time.monotonic() + 10
    while census.get() != (1, 7):
        assert time.monotonic() < deadline, "the background recount never landed"
        time.sleep(0.05)
