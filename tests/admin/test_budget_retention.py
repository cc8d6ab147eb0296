"""Budget arithmetic, quota validation, inventory classes and the retention ranking order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpersist.admin.budget import (
    GIB,
    BudgetModel,
    QuotaError,
    device_ceiling,
    load_quotas,
    over_quota,
    save_quotas,
    validate_quotas,
)
from kvpersist.admin.retention import plan_cleanup
from kvpersist.l2.inventory import InventoryError, build_inventory
from kvpersist.l2.layout import KeyFields, format_name

NS = ["kvp-" + c * 32 for c in "abcd"]


def test_budget_arithmetic() -> None:
    b = BudgetModel.from_gb(1500)
    assert b.cap_bytes == 1500 * GIB
    assert b.trigger_bytes == int(1500 * GIB * 0.9)
    assert b.reclaim_target_bytes == int(1500 * GIB * 0.81)
    assert b.share(750 * GIB) == 0.5


def test_device_ceiling(tmp_path: Path) -> None:
    ok = device_ceiling(tmp_path, cache_bytes=0, cap_bytes=1)
    assert ok.ok and ok.ceiling_bytes == ok.free_bytes
    too_big = device_ceiling(tmp_path, cache_bytes=5, cap_bytes=ok.free_bytes + 10 * GIB)
    assert not too_big.ok and "Lower KVP_CACHE_BUDGET_GB" in too_big.message()


@pytest.mark.parametrize(("data", "fragment"), [
    ([], "expected a JSON object"),
    ({"quota": {}}, "unknown key"),
    ({"version": 2, "quotas": {}}, "unsupported version"),
    ({"quotas": {"kvp-123": 1}}, "is not a namespace"),
    ({"quotas": {NS[0]: -1}}, "non-negative"),
    ({"quotas": {NS[0]: "10"}}, "must be a number"),
    ({"quotas": {NS[0]: True}}, "must be a number"),
])
def test_quota_validation(data: object, fragment: str) -> None:
    with pytest.raises(QuotaError, match=fragment):
        validate_quotas(data)


def test_quota_round_trip_and_over_quota(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    assert load_quotas(path) == {}
    save_quotas(path, {NS[0]: 2 * GIB, NS[1]: GIB // 2})
    assert load_quotas(path) == {NS[0]: 2 * GIB, NS[1]: GIB // 2}
    assert over_quota({NS[0]: 3 * GIB, NS[1]: 1}, load_quotas(path)) == {NS[0]: GIB}
    path.write_text("{not json")
    with pytest.raises(QuotaError, match="not valid JSON"):
        load_quotas(path)


def make_file(root: Path, ns: str, i: int, size: int, mtime: float) -> Path:
    key = KeyFields(f"org/m/{ns}", 0x01000100, 0, i.to_bytes(32, "big"))
    path = root / format_name(key)
    path.write_bytes(b"\0" * size)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    (root / "quarantine").mkdir(parents=True)
    make_file(root, NS[0], 1, 100, 1000)  # inactive, oldest access 1000
    make_file(root, NS[0], 2, 100, 1001)
    make_file(root, NS[1], 3, 100, 2000)  # inactive, newer
    make_file(root, NS[2], 4, 100, 500)  # active, over quota
    make_file(root, NS[2], 5, 100, 600)
    make_file(root, NS[2], 6, 100, 700)
    make_file(root, NS[3], 7, 100, 100)  # active
    (root / (format_name(KeyFields("o/m", 0, 0, b"\1")) + ".tmp.abcd")).write_bytes(b"x" * 10)
    young = root / (format_name(KeyFields("o/m", 0, 0, b"\2")) + ".tmp.ef01")
    young.write_bytes(b"x" * 10)
    old_tmp = root / (format_name(KeyFields("o/m", 0, 0, b"\1")) + ".tmp.abcd")
    os.utime(old_tmp, (10, 10))
    (root / "quarantine" / "x.kvp.payload-checksum.1").write_bytes(b"q" * 50)
    (root / "lmcache-server.log").write_text("log")
    (root / "notes.kvp").write_bytes(b"?")  # unparsable name
    (root / "escape").symlink_to("/etc")
    return root


def test_inventory_classes(tree: Path) -> None:
    inv = build_inventory(tree)
    classes = inv.by_class()
    assert classes["live"] == (7, 700)
    assert classes["temp"] == (2, 20)
    assert classes["quarantine"] == (1, 50)
    assert classes["unparsable"] == (1, 1)
    assert classes["foreign"][0] == 2  # the log and the symlink (never followed)
    ns = inv.namespaces()
    assert ns[NS[2]].files == 3 and ns[NS[2]].bytes == 300 and ns[NS[2]].last_access == 700
    assert ns[NS[0]].model_ids == {"org/m"}


def test_inventory_bad_root(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="does not exist"):
        build_inventory(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(InventoryError, match="not a directory"):
        build_inventory(tmp_path / "f")


def test_ranking_order_without_target(tree: Path) -> None:
    inv = build_inventory(tree)
    plan = plan_cleanup(inv, active={NS[2], NS[3]}, quotas={NS[2]: 150}, now=10_000)
    reasons = [i.reason for i in plan.items]
    assert reasons == ["temp", "quarantine", "inactive", "inactive", "inactive",
                       "over-quota", "over-quota"]  # the young temp file is skipped
    inactive = [i.file.namespace for i in plan.items if i.reason == "inactive"]
    assert inactive == [NS[0], NS[0], NS[1]]  # oldest last access first
    quota_files = [i.file.mtime for i in plan.items if i.reason == "over-quota"]
    assert quota_files == [500, 600]  # oldest first, down to the quota
    assert all(i.file.cls != "foreign" for i in plan.items)


def test_young_temp_files_are_skipped(tree: Path) -> None:
    plan = plan_cleanup(build_inventory(tree), active=set(), min_temp_age_s=300)
    assert plan.skipped_young_temp == 1
    assert sum(1 for i in plan.items if i.reason == "temp") == 1


def test_ranking_stops_at_target_and_uses_lru_tail(tree: Path) -> None:
    inv = build_inventory(tree)
    start = inv.cache_bytes
    plan = plan_cleanup(inv, active={NS[2], NS[3]}, target_bytes=start - 500, now=10_000)
    assert plan.end_bytes <= start - 500
    assert plan.items[-1].reason in ("inactive", "lru-active")
    deep = plan_cleanup(inv, active={NS[2], NS[3]}, target_bytes=0, now=10_000)
    lru = [i.file.mtime for i in deep.items if i.reason == "lru-active"]
    assert lru == sorted(lru) and lru[0] == 100
    assert deep.end_bytes == 10  # only the young temp file (a store in progress) remains
    assert deep.notes == ["the target cannot be reached with what may be removed"]


def test_plan_restricted_to_namespace(tree: Path) -> None:
    plan = plan_cleanup(build_inventory(tree), active=set(), only_namespaces={NS[1]}, now=10_000)
    assert [i.file.namespace for i in plan.items] == [NS[1]]


def test_plan_is_deterministic(tree: Path) -> None:
    inv = build_inventory(tree)
    a = plan_cleanup(inv, active={NS[3]}, target_bytes=100, now=10_000)
    b = plan_cleanup(build_inventory(tree), active={NS[3]}, target_bytes=100, now=10_000)
    assert [str(i.file.path) for i in a.items] == [str(i.file.path) for i in b.items]


def test_quotas_file_json_shape(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    save_quotas(path, {NS[0]: GIB})
    assert json.loads(path.read_text()) == {"version": 1, "quotas": {NS[0]: 1.0}}
