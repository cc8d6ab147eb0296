"""Which namespaces a cleanup on a shared tree must treat as active: those recorded in parts a
live server holds, found by lock probes and records alone; when the tree's parts cannot be
listed, nobody knows, and ``cleanup --apply`` refuses without ``--active``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpersist.admin.cli import common, main
from kvpersist.admin.tree import live_recorded_namespaces
from kvpersist.identity.records import RECORDS_DIR
from kvpersist.l2.inventory import InventoryError
from kvpersist.l2.lock import take_root_lock

NS_LIVE, NS_DEAD = "kvp-" + "1" * 32, "kvp-" + "2" * 32


def make_part(tree: Path, node: str, namespace: str) -> Path:
    root = tree / "nodes" / node
    (root / RECORDS_DIR).mkdir(parents=True)
    (root / RECORDS_DIR / f"{namespace}.json").write_text("{}")  # unusable, still recorded
    return root


def test_only_live_parts_protect_their_recorded_namespaces(tmp_path: Path) -> None:
    live = make_part(tmp_path, "a", NS_LIVE)
    make_part(tmp_path, "b", NS_DEAD)  # no server holds b's lock
    fd = take_root_lock(live)
    try:
        assert live_recorded_namespaces(tmp_path) == {NS_LIVE}
    finally:
        os.close(fd)
    assert live_recorded_namespaces(tmp_path) == set()  # a's server gone: nothing protected
    with pytest.raises(InventoryError, match="cannot be listed"):
        live_recorded_namespaces(tmp_path / "not-a-tree")


def test_apply_refuses_when_the_tree_cannot_be_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before, a listing failure counted as "no live node serves anything": --apply would
    have deleted namespaces live nodes were serving."""
    root = make_part(tmp_path / "tree", "a", NS_LIVE)
    doomed = root / f"org--m--{NS_LIVE}_01000100_0_ab.kvp"
    doomed.write_bytes(b"x" * 4096)
    monkeypatch.setenv("KVP_CACHE_ROOT", str(tmp_path / "tree"))
    monkeypatch.setenv("KVP_NODE_ID", "a")
    monkeypatch.setenv("KVP_SHARED_NODES", "2")
    monkeypatch.setenv("KVP_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("KVP_HTTP_PORT", "9")
    monkeypatch.setenv("KVP_CACHE_BUDGET_GB", "1")

    def unlistable(tree: Path) -> set[str]:  # a mount that cannot be listed (EIO, ENOTCONN)
        raise InventoryError(f"{tree}/nodes cannot be listed (Transport endpoint is not "
                             "connected)")

    monkeypatch.setattr(common, "live_recorded_namespaces", unlistable)
    code = main(["cleanup", "--apply", "--target-gb", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "unknown (the tree's parts cannot be listed" in err and "--active" in err
    assert doomed.exists()
    assert main(["cleanup", "--apply", "--target-gb", "0", "--active", "kvp-" + "3" * 32]) == 0
    assert not doomed.exists()  # told explicitly, it goes
