"""The LMCache log lines that end-to-end tests wait on are in the installed LMCache, once each:
a renamed line fails here, by name, instead of as a timeout in an end-to-end test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvpersist.testing import lmcache_log


@pytest.mark.parametrize("line", [lmcache_log.UNHEALTHY, lmcache_log.HEALTHY_AGAIN,
                                  lmcache_log.REREGISTERED])
def test_each_line_is_logged_once_by_lmcache(line: str) -> None:
    spec = importlib.util.find_spec(lmcache_log.SOURCE_MODULE)  # the file, without importing it
    assert spec is not None and spec.origin is not None, lmcache_log.SOURCE_MODULE
    assert Path(spec.origin).read_text().count(line) == 1, line


def test_count_counts_the_lines_written_so_far(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(f"a {lmcache_log.REREGISTERED}\nb\n{lmcache_log.REREGISTERED} c\n")
    assert lmcache_log.count(log, lmcache_log.REREGISTERED) == 2
    assert lmcache_log.count(log, lmcache_log.UNHEALTHY) == 0
