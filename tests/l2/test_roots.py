"""Several roots, one tier: placement by key, per-root accounting, a lost root given up alone
and taken back after a scan.  Real stores on real directories; the device faults of real block
devices are in test_roots_devices.py."""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpersist.l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.lease import Lease
from kvpersist.l2.placement import place, rank
from kvpersist.l2.root_health import RootRefused, RootRegister, claim, probe
from kvpersist.l2.roots import DEGRADED, HEALTHY, RootSet, shares
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.helpers import exchange_paths, key_of, wait_until

PAYLOAD = 4096


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(PAYLOAD))


class Ledger:
    """What LMCache would have been told: every key announced stored and not yet deleted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: Counter[KeyFields] = Counter()

    def added(self, keys: list[KeyFields], sizes: list[int]) -> None:
        with self.lock:
            for key, size in zip(keys, sizes, strict=True):
                self.held[key] += size

    def removed(self, keys: list[KeyFields], sizes: list[int]) -> None:
        with self.lock:
            for key, size in zip(keys, sizes, strict=True):
                self.held[key] -= size
                if self.held[key] == 0:
                    del self.held[key]

    def as_dict(self) -> dict[KeyFields, int]:
        with self.lock:
            return dict(self.held)


def root_set(roots: list[Path], ledger: Ledger, capacity: int = 1 << 30,
             **kw: Any) -> RootSet:
    def factory(path: Path, cap: int, on_added: Any, on_removed: Any) -> KvFileStore:
        return KvFileStore(path, cap, on_added=on_added, on_removed=on_removed)

    rs = RootSet(roots, shares(capacity, len(roots)), factory, on_added=ledger.added,
                 on_removed=ledger.removed, **kw)
    rs.open(background_scan=False)
    return rs


def test_placement_is_stable_even_and_moves_only_to_a_new_root() -> None:
    keys = [key_of(i) for i in range(4000)]
    four = ["/nvme0/kv", "/nvme1/kv", "/nvme2/kv", "/nvme3/kv"]
    placed = [place(k, four) for k in keys]
    assert placed == [place(k, list(four)) for k in keys]  # a pure function of key and roots
    counts = Counter(placed)
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(850 <= n <= 1150 for n in counts.values()), counts  # 1000 ± 4.7 sigma
    assert all(rank(k, four)[0] == p for k, p in zip(keys, placed, strict=True))
    five = [*four, "/nvme4/kv"]
    moved = [(p, place(k, five)) for k, p in zip(keys, placed, strict=True)
             if place(k, five) != p]
    assert all(new == 4 for _, new in moved)  # only to the new root
    assert 600 <= len(moved) <= 1000  # about a fifth


def test_each_key_lands_on_its_root_and_the_totals_are_the_roots_sums(tmp_path: Path) -> None:
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    ledger = Ledger()
    rs = root_set(roots, ledger)
    try:
        keys = [key_of(i) for i in range(60)]
        for i, key in enumerate(keys):
            assert rs.put(key, payload(i)) == "stored"
        names = [str(r) for r in roots]
        for key in keys:
            assert rs.path_for(key).parent == roots[place(key, names)]
            assert rs.path_for(key).exists()
        assert all(any(r.iterdir()) for r in roots)
        buf = bytearray(PAYLOAD)
        for i, key in enumerate(keys):
            assert rs.read_into(key, buf) and bytes(buf) == payload(i)
        status = rs.status()
        per_root = status["roots"]
        assert [e["state"] for e in per_root] == [HEALTHY] * 3
        assert status["files"] == 60 == sum(e["files"] for e in per_root)
        assert status["used_bytes"] == 60 * (HEADER_SIZE + PAYLOAD) == rs.used_bytes
        assert sum(status["root_used_bytes"].values()) == status["used_bytes"]
        assert status["capacity_bytes"] == 1 << 30 == sum(e["capacity_bytes"] for e in per_root)
        assert rs.usage_fraction() == max(e["used_bytes"] / e["capacity_bytes"]
                                          for e in per_root)
        assert ledger.as_dict() == rs.indexed_sizes()
        page, cursor = rs.list_keys(None, None, 25)
        listed = list(page)
        while cursor is not None:
            page, cursor = rs.list_keys(None, cursor, 25)
            listed += page
        assert sorted(k for k, _ in listed) == sorted(keys)
        assert rs.check(deep=True) == []
    finally:
        rs.close()


def test_keys_stay_found_and_counted_once_after_a_root_is_added(tmp_path: Path) -> None:
    roots = [tmp_path / "dev0", tmp_path / "dev1"]
    keys = [key_of(i) for i in range(40)]
    ledger = Ledger()
    rs = root_set(roots, ledger)
    for i, key in enumerate(keys):
        assert rs.put(key, payload(i)) == "stored"
    rs.close()
    grown = [*roots, tmp_path / "dev2"]
    names = [str(r) for r in grown]
    moved = [k for k in keys if place(k, names) == 2]
    assert moved, "no key prefers the new root; pick other keys"
    ledger = Ledger()
    rs = root_set(grown, ledger)
    try:
        buf = bytearray(PAYLOAD)
        for i, key in enumerate(keys):
            assert rs.read_into(key, buf) and bytes(buf) == payload(i)
            assert rs.put(key, payload(i)) == "exists"  # never a second copy on the new root
        assert not any(p.suffix == ".kvp" for p in (tmp_path / "dev2").iterdir())
        assert rs.contains_many(keys) == [True] * len(keys)
        assert len(rs) == 40 and ledger.as_dict() == rs.indexed_sizes()
        assert rs.delete(moved[0]) == HEADER_SIZE + PAYLOAD  # deleted where it is
        assert not rs.contains(moved[0])
        assert rs.check() == []
    finally:
        rs.close()


def test_a_restore_ranks_each_key_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore asks for the same keys three times (the lookup, the load's dispatch to a
    root's threads, the read); the rendezvous hash runs once per key, not once per step."""
    from kvpersist.l2 import roots as roots_module

    roots = [tmp_path / f"dev{i}" for i in range(3)]
    keys = [key_of(i) for i in range(50)]
    rs = root_set(roots, Ledger())
    for i, key in enumerate(keys):
        assert rs.put(key, payload(i)) == "stored"
    rs.close()
    ranked: Counter[KeyFields] = Counter()
    real_rank = roots_module.rank

    def counting_rank(key: KeyFields, roots: Any) -> list[int]:
        ranked[key] += 1
        return real_rank(key, roots)

    monkeypatch.setattr(roots_module, "rank", counting_rank)
    rs = root_set(roots, Ledger())  # after a restart: no key ranked yet
    try:
        assert rs.contains_many(keys) == [True] * len(keys)
        buf = bytearray(PAYLOAD)
        for i, key in enumerate(keys):
            assert 0 <= rs.root_index(key) < 3
            assert rs.read_into(key, buf) and bytes(buf) == payload(i)
        assert ranked == Counter(keys)
    finally:
        rs.close()


def test_a_lost_root_costs_only_its_keys_and_rejoins_after_a_scan(tmp_path: Path) -> None:
    roots = [tmp_path / "dev0", tmp_path / "dev1"]
    names = [str(r) for r in roots]
    ledger = Ledger()
    rs = root_set(roots, ledger, probe_interval_s=0.1)
    try:
        keys = [key_of(i) for i in range(40)]
        for i, key in enumerate(keys):
            assert rs.put(key, payload(i)) == "stored"
        on_lost = [k for k in keys if place(k, names) == 1]
        kept = [k for k in keys if place(k, names) == 0]
        assert on_lost and kept
        # the device goes away: an empty mount point is left where it was, in one step, as an
        # unmount does (a probe never finds the path missing)
        away = tmp_path / "dev1-away"
        away.mkdir()
        exchange_paths(roots[1], away)
        wait_until(lambda: rs.degraded, timeout=10, message="the lost root was never degraded")
        (path, reason), = rs.degraded
        assert path == roots[1] and "no longer holds root" in reason
        assert ledger.as_dict() == rs.indexed_sizes()  # its bytes left the accounting
        assert set(ledger.as_dict()) == set(kept)
        buf = bytearray(PAYLOAD)
        assert not any(rs.read_into(k, buf) for k in on_lost)
        assert all(rs.read_into(k, buf) for k in kept)
        assert rs.contains_many(keys) == [k in kept for k in keys]
        assert rs.put(on_lost[0], payload(0)) == "degraded"
        assert not any((roots[1]).iterdir())  # nothing written to the empty mount point
        status = rs.status()
        assert status["degraded_roots"] == [{"root": names[1], "reason": reason}]
        assert status["root_degraded"] == {names[0]: 0, names[1]: 1}
        assert status["used_bytes"] == len(kept) * (HEADER_SIZE + PAYLOAD)
        assert status["stores"] == 40  # counters of the given-up store are kept
        assert rs.check() == []
        # the device comes back: its keys serve again once its scan has run
        exchange_paths(roots[1], away)
        wait_until(lambda: not rs.degraded and rs.scan_done, timeout=10,
                   message="the root never rejoined")
        for i, key in enumerate(keys):
            assert rs.read_into(key, buf) and bytes(buf) == payload(i)
        assert set(ledger.as_dict()) == set(keys) and ledger.as_dict() == rs.indexed_sizes()
        assert rs.status()["roots"][1]["degrades"] == 1
        assert rs.check() == []
    finally:
        rs.close()


class HangingStore(KvFileStore):
    """A store whose reads of the keys in ``hang`` wait until ``release`` is set: a read stuck
    in the kernel on a device that stopped answering (a D-state ``pread`` no signal ends)."""

    hang: ClassVar[set[KeyFields]] = set()
    release = threading.Event()
    stuck = threading.Event()

    def read_into(self, key: KeyFields, buf: Any, lease: Lease | None = None) -> bool:
        if key in self.hang:
            self.stuck.set()
            self.release.wait(60)
        return super().read_into(key, buf, lease)


def test_a_hung_device_s_stuck_reads_block_nothing_and_its_keys_leave_when_they_return(
        tmp_path: Path) -> None:
    """Root 1 is lost while a read on it is stuck: it is degraded at once, the watch goes on
    (root 2, lost next, is noticed too), its counters stay reported and its keys stay in the
    accounting while the read is out; when the read returns, the store is abandoned and the
    accounting drops exactly its keys; back, it rejoins only then."""
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    names = [str(r) for r in roots]
    ledger = Ledger()

    def factory(path: Path, cap: int, on_added: Any, on_removed: Any) -> KvFileStore:
        return HangingStore(path, cap, on_added=on_added, on_removed=on_removed)

    HangingStore.hang, HangingStore.release, HangingStore.stuck = (
        set(), threading.Event(), threading.Event())
    rs = RootSet(roots, shares(1 << 30, 3), factory, on_added=ledger.added,
                 on_removed=ledger.removed, probe_interval_s=0.1)
    rs.open(background_scan=False)
    reader: threading.Thread | None = None
    try:
        keys = [key_of(i) for i in range(60)]
        for i, key in enumerate(keys):
            assert rs.put(key, payload(i)) == "stored"
        by_root = {r: [k for k in keys if place(k, names) == r] for r in range(3)}
        assert all(by_root.values())
        HangingStore.hang = {by_root[1][0]}
        got: list[bool] = []
        stuck_buf = bytearray(PAYLOAD)
        reader = threading.Thread(target=lambda: got.append(
            rs.read_into(by_root[1][0], stuck_buf)), daemon=True)
        reader.start()
        assert HangingStore.stuck.wait(10)
        away = [tmp_path / "dev1-away", tmp_path / "dev2-away"]
        for a in away:
            a.mkdir()
        exchange_paths(roots[1], away[0])
        wait_until(lambda: [p for p, _ in rs.degraded] == [roots[1]], timeout=10,
                   message="the hung root was never degraded")
        entry = rs.status()["roots"][1]
        assert entry["state"] == DEGRADED and entry["in_flight"] == 1
        assert entry["stores"] == len(by_root[1])  # its counters are still reported
        assert set(by_root[1]) <= set(ledger.as_dict())  # not abandoned under the stuck read
        buf = bytearray(PAYLOAD)
        assert all(rs.read_into(k, buf) for k in by_root[0] + by_root[2])  # the others serve
        exchange_paths(roots[2], away[1])  # a second device lost while the first hangs
        wait_until(lambda: len(rs.degraded) == 2, timeout=10,
                   message="the watch stopped while a degraded root's read was stuck")
        assert set(ledger.as_dict()) == set(by_root[0]) | set(by_root[1])
        exchange_paths(roots[1], away[0])  # back, but its stuck read is not: no new store yet
        exchange_paths(roots[2], away[1])
        wait_until(lambda: [p for p, _ in rs.degraded] == [roots[1]], timeout=10,
                   message="root 2 never rejoined")
        assert rs.status()["roots"][1]["in_flight"] == 1
        HangingStore.release.set()
        reader.join(timeout=10)
        # the stuck read ends as its device answers: a verified read, or a miss
        assert len(got) == 1 and (not got[0] or bytes(stuck_buf) == payload(keys.index(
            by_root[1][0])))
        wait_until(lambda: not rs.degraded and rs.scan_done, timeout=10,
                   message="root 1 never rejoined after its read returned")
        assert set(ledger.as_dict()) == set(keys) and ledger.as_dict() == rs.indexed_sizes()
        assert rs.status()["roots"][1]["stores"] == len(by_root[1])  # counters never go back
        assert rs.check() == []
    finally:
        HangingStore.release.set()
        if reader is not None:
            reader.join(timeout=10)
        rs.close()


def test_a_root_unmounted_during_a_probe_is_named_as_unmounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe read the marker, then the device left before its write: the reason is the
    missing device, not the write's ENOENT (CI once saw that race)."""
    root, away = tmp_path / "dev1", tmp_path / "dev1-away"
    root.mkdir()
    away.mkdir()
    identity = claim(root, RootRegister(tmp_path))
    assert probe(root, identity) is None
    real_open = os.open

    def unmount_then_open(path: Any, flags: int, mode: int = 0o777) -> int:
        exchange_paths(root, away)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", unmount_then_open)  # the probe's scratch write
    why = probe(root, identity)
    assert why is not None and "no longer holds root" in why and "no marker" in why


def test_a_root_remounted_read_only_during_a_probe_is_named_read_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remount lands between the probe's statvfs and its write: the write's EROFS is the
    same fault, named as read-only (CI once saw "cannot be written (Read-only file system)")."""
    root = tmp_path / "dev1"
    root.mkdir()
    identity = claim(root, RootRegister(tmp_path))
    assert probe(root, identity) is None

    def remounted_then_open(path: Any, flags: int, mode: int = 0o777) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "open", remounted_then_open)  # the probe's scratch write
    assert probe(root, identity) == f"{root} is read-only"


def test_a_root_is_taken_only_as_the_device_this_tier_wrote(tmp_path: Path) -> None:
    primary, other = tmp_path / "dev0", tmp_path / "dev1"
    primary.mkdir()
    register = RootRegister(primary)
    identity = claim(other, register)
    assert claim(other, register) == identity  # the same device again
    (other / ".kvpersist-state" / "root-id").write_text("f" * 32 + "\n")
    with pytest.raises(RootRefused, match="another device is mounted there"):
        claim(other, register)
    (other / ".kvpersist-state" / "root-id").unlink()
    with pytest.raises(RootRefused, match="not mounted there"):
        claim(other, register)
    moved = tmp_path / "dev2"
    (moved / ".kvpersist-state").mkdir(parents=True)
    (moved / ".kvpersist-state" / "root-id").write_text("a" * 32 + "\n")
    assert claim(moved, register) == "a" * 32  # a known device at a new path keeps its id


def test_a_root_refused_at_start_is_degraded_and_the_others_serve(tmp_path: Path) -> None:
    roots = [tmp_path / "dev0", tmp_path / "dev1"]
    ledger = Ledger()
    root_set(roots, ledger).close()
    (roots[1] / ".kvpersist-state" / "root-id").unlink()  # as an unmounted mount point shows
    rs = root_set(roots, ledger, probe_interval_s=0.1)
    try:
        assert [p for p, _ in rs.degraded] == [roots[1]]
        key = next(key_of(i) for i in range(100) if place(key_of(i), [str(r) for r in roots]) == 0)
        assert rs.put(key, payload(1)) == "stored"
        assert rs.status()["roots"][1]["state"] == DEGRADED
    finally:
        rs.close()


def test_the_adapter_spreads_its_budget_and_reports_the_fullest_root(tmp_path: Path) -> None:
    config = KvPersistL2AdapterConfig.from_dict(
        {"path": str(tmp_path / "dev0"), "extra_paths": [str(tmp_path / "dev1")],
         "max_capacity_gb": 1})
    a = KvPersistL2Adapter(config)
    try:
        assert a.store.wait_scan(10)
        for i in range(30):
            assert a.store.put(key_of(i), payload(i)) == "stored"
        assert a.wait_announced(10)
        usage = a.get_usage()
        assert usage.total_bytes_used == a.store.used_bytes == 30 * (HEADER_SIZE + PAYLOAD)
        assert usage.usage_fraction == pytest.approx(a.store.usage_fraction(), rel=1e-6)
        status = a.report_status()
        assert status["is_healthy"] and len(status["roots"]) == 2
        assert [e["capacity_bytes"] for e in status["roots"]] == [1 << 29, 1 << 29]
    finally:
        a.close()


@pytest.mark.parametrize("params, message", [
    ({"extra_paths": "/nvme1"}, "extra_paths must be a list"),
    ({"extra_paths": ["/nvme0/kv"]}, "a root is given twice"),
    ({"extra_paths": ["/nvme1"], "shared_tree": "/tree"}, "do not go together"),
])
def test_the_adapter_config_refuses_bad_roots(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvPersistL2AdapterConfig.from_dict({"path": "/nvme0/kv", "max_capacity_gb": 1, **params})
