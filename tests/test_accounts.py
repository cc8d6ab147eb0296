"""Commands as other accounts reach the test's Python and package wherever the checkout sits,
including a ``mktemp -d`` directory (mode 0700) that the account may not enter, and see
nothing else of the directories veiled on the way."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.testing import accounts


def under(base: Path, plan: dict[Path, set[str] | None]) -> dict[Path, set[str] | None]:
    """The plan's veils inside ``base`` (pytest's own base directory is closed too)."""
    return {d: e for d, e in plan.items() if d.is_relative_to(base)}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Outside pytest's closed base directory, which the namespace veils."""
    path = Path(tempfile.mkdtemp(prefix="kvp-acct-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_closed_directory_on_the_way_is_veiled_with_only_that_entry(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "open" / "deep").mkdir(parents=True)
    closed.chmod(0o700)
    tmp_path.chmod(0o755)
    assert under(tmp_path, accounts.veils([closed / "open" / "deep"])) == {closed: {"open"}}


def test_a_closed_target_binds_every_entry_and_open_paths_need_no_veil(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    shut_inside = tmp_path / "open" / "shut" / "x"
    shut_inside.mkdir(parents=True)
    (tmp_path / "open").chmod(0o755)
    (tmp_path / "open" / "shut").chmod(0o750)
    plan = under(tmp_path, accounts.veils([target, shut_inside, tmp_path / "open"]))
    assert plan == {target: accounts.ALL_ENTRIES, tmp_path / "open" / "shut": {"x"}}


def test_veils_run_shallowest_first(tmp_path: Path) -> None:
    outer = tmp_path / "a"
    inner = outer / "b"
    (inner / "c").mkdir(parents=True)
    outer.chmod(0o700)
    inner.chmod(0o700)
    tmp_path.chmod(0o755)
    assert list(under(tmp_path, accounts.veils([inner / "c", outer]))) == [outer, inner]


@pytest.mark.skipif(accounts.unavailable() is not None, reason=str(accounts.unavailable()))
def test_an_account_runs_from_a_closed_checkout_and_sees_only_what_it_needs(
        tmp_path: Path, scratch: Path) -> None:
    checkout = tmp_path / "checkout"  # as `mktemp -d` makes it
    (checkout / "tool").mkdir(parents=True)
    (checkout / "tool" / "data").write_text("reachable")
    (checkout / "secret").write_text("not for the account")
    checkout.chmod(0o700)
    tmp_path.chmod(0o755)
    code = ("import os, sys, kvpersist; print(os.getuid()); "
            f"print(open({str(checkout / 'tool' / 'data')!r}).read()); "
            f"print(sorted(os.listdir({str(checkout)!r})))")
    run = subprocess.run(
        accounts.as_account([sys.executable, "-c", code], uid=accounts.VLLM_UID,
                            gid=accounts.VLLM_UID, scratch=scratch, reach=[checkout / "tool"]),
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == [str(accounts.VLLM_UID), "reachable", "['tool']"]
    assert (checkout / "secret").exists() and checkout.stat().st_mode & 0o777 == 0o700


def test_a_scratch_under_a_veiled_directory_is_refused(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "tool").mkdir(parents=True)
    closed.chmod(0o700)
    with pytest.raises(ValueError, match="veils"):
        accounts.as_account(["true"], uid=accounts.VLLM_UID, gid=accounts.VLLM_UID,
                            scratch=closed / "scratch", reach=[closed / "tool"])
