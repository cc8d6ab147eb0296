"""``kvp-admin`` over several roots (``KVP_CACHE_EXTRA_ROOTS``): report, verify, verify --check
and cleanup see every device's files, per device where it matters, and act on each file in its
own root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import format_name
from kvpersist.l2.roots import RootSet, shares
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.corruption import corrupt_file
from kvpersist.testing.helpers import key_of

NS_OLD, NS_NEW = "kvp-" + "1" * 32, "kvp-" + "2" * 32
PAYLOAD = 2048
FILE = HEADER_SIZE + PAYLOAD


def _ignore(keys: object, sizes: object) -> None:
    return None


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    paths = [tmp_path / "nvme0" / "kv", tmp_path / "nvme1" / "kv"]
    rs = RootSet(paths, shares(10**9, 2),
                 lambda p, c, a, r: KvFileStore(p, c, on_added=a, on_removed=r),
                 on_added=_ignore, on_removed=_ignore)
    rs.open(background_scan=False)
    try:
        for i in range(12):
            for ns in (NS_OLD, NS_NEW):
                assert rs.put(key_of(i, ns), bytes([i]) * PAYLOAD) == "stored"
    finally:
        rs.close()
    monkeypatch.setenv("KVP_CACHE_ROOT", str(paths[0]))
    monkeypatch.setenv("KVP_CACHE_EXTRA_ROOTS", str(paths[1]))
    monkeypatch.setenv("KVP_HTTP_PORT", "9")  # nothing answers: the server is "down"
    monkeypatch.setenv("KVP_CACHE_BUDGET_GB", "1")
    monkeypatch.setenv("KVP_L1_SIZE_GB", "1")
    return paths


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _kvp(root: Path) -> list[Path]:
    return sorted(root.glob("*.kvp"))


def test_report_counts_every_device_and_each_one_apart(
        roots: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    on_disk = [len(_kvp(r)) for r in roots]
    assert all(on_disk) and sum(on_disk) == 24
    code, out, _ = run(capsys, "report", "--json")
    data = json.loads(out)
    assert code == 0
    assert {r["namespace"]: r["files"] for r in data["namespaces"]} == {NS_OLD: 12, NS_NEW: 12}
    assert [(r["root"], r["files"], r["bytes"]) for r in data["roots"]] == [
        (str(r), n, n * FILE) for r, n in zip(roots, on_disk, strict=True)]
    assert [r["budget_bytes"] for r in data["roots"]] == shares(2**30, 2)
    code, out, _ = run(capsys, "report")
    assert code == 0 and "root (device)" in out and str(roots[1]) in out


def test_verify_and_check_cover_every_root_and_quarantine_in_place(
        roots: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", "--check", "--json")
    assert code == 0 and json.loads(out) == {"files": 24, "bytes": 24 * FILE, "problems": []}
    victim = _kvp(roots[1])[0]
    corrupt_file(victim, "flip")
    code, out, _ = run(capsys, "verify", "--quarantine", "--json")
    data = json.loads(out)
    assert data["checked"] == 24 and [f["path"] for f in data["failures"]] == [str(victim)]
    assert data["quarantined"] == 1
    assert [p.name.split(".kvp.")[0] + ".kvp" for p in (roots[1] / "quarantine").iterdir()] \
        == [victim.name]  # in its own root's quarantine, not across devices
    # the same key on two roots is found by the check
    twin = _kvp(roots[0])[0]
    (roots[1] / twin.name).write_bytes(twin.read_bytes())
    code, out, _ = run(capsys, "verify", "--check", "--json")
    problems = json.loads(out)["problems"]
    assert code == 3 and any(f"{twin.name} is on {roots[0]} and on {roots[1]}" == p
                             for p in problems), problems


def test_cleanup_removes_an_old_namespace_from_every_device(
        roots: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "cleanup", "--apply", "--active", NS_NEW, "--json")
    assert code == 0, out
    for root in roots:
        names = [p.name for p in _kvp(root)]
        assert names and all(NS_NEW in n for n in names)
    assert sum(len(_kvp(r)) for r in roots) == 12
    assert format_name(key_of(0, NS_NEW)) in {p.name for r in roots for p in _kvp(r)}


def test_preflight_warns_of_two_roots_on_one_device(tmp_path: Path) -> None:
    from kvpersist.admin.preflight import roots_checks

    first, second = roots_checks((tmp_path / "a", tmp_path / "b"), 2 * 2**20)
    assert first.level == "ok" and "free for a share of" in first.message
    assert second.level == "warn" and f"on the same device as {tmp_path / 'a'}" in second.message
