"""Stores of several nodes on one tree (here on a local directory; over a real GlusterFS volume in
``tests/shared``): each writes its own part, finds the others' files, never touches them, and
counts only its own bytes.  Every test ends on ``check()`` of each node's store."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.lock import root_lock_holder
from kvpersist.l2.shared_tree import SharedTree
from kvpersist.l2.store import KvFileStore, RootLockedError
from kvpersist.testing.corruption import corrupt_file

from .test_store import key, payload

_OPENED: list[KvFileStore] = []


def node(tree: Path, name: str, capacity: int = 10**9, ttl: float = 60.0) -> KvFileStore:
    store = KvFileStore(tree / "nodes" / name, capacity, shared_tree=tree,
                        shared_negative_ttl_s=ttl)
    store.open(background_scan=False)
    _OPENED.append(store)
    return store


@pytest.fixture(autouse=True)
def every_node_ends_consistent() -> Iterator[None]:
    _OPENED.clear()
    yield
    for store in _OPENED:
        assert store.check(deep=True) == []
        store.close()


def test_a_key_written_by_one_node_is_read_by_another(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    assert a.put(key(1), payload(1)) == "stored"
    assert b.contains(key(1))
    buf = bytearray(len(payload(1)))
    assert b.read_into(key(1), buf) and bytes(buf) == payload(1)
    assert b.stats.foreign_hits == 1
    # B's accounting holds only what B wrote; A's holds it.
    assert (len(b), b.used_bytes) == (0, 0)
    assert (len(a), a.used_bytes) == (1, HEADER_SIZE + len(payload(1)))
    # B never writes a second copy of a key the tree has.
    assert b.put(key(1), payload(1)) == "exists"
    assert b.stats.store_exists_elsewhere == 1 and len(b) == 0
    assert not (b.root / a.path_for(key(1)).name).exists()


def test_a_miss_is_remembered_for_the_negative_ttl_then_looked_for_again(tmp_path: Path) -> None:
    clock = [0.0]
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    assert b.shared is not None
    b.shared = SharedTree(tmp_path, b.root, lambda k: (a.path_for(k).name,),
                          negative_ttl_s=2.0, clock=lambda: clock[0])
    assert not b.contains(key(2))
    ops = b.shared.status()["fs_ops"]
    assert a.put(key(2), payload(2)) == "stored"
    clock[0] = 1.0
    assert not b.contains(key(2))  # still within the negative TTL: no file-system operation
    assert b.shared.status()["fs_ops"] == ops
    assert b.shared.status()["cached_missed"] == 1
    clock[0] = 2.5
    assert b.contains(key(2))  # TTL over: one stat per other node finds it
    found_ops = b.shared.status()["fs_ops"] - ops
    assert found_ops == 1  # one other node, node list still fresh
    assert b.contains(key(2)) and b.shared.status()["fs_ops"] - ops == found_ops  # cached


def test_a_lookup_miss_costs_one_stat_per_other_node(tmp_path: Path) -> None:
    nodes = [node(tmp_path, f"n{i}") for i in range(5)]
    probe = nodes[0]
    assert probe.shared is not None
    probe.shared.other_parts()  # the node list, listed once
    before = probe.shared.status()["fs_ops"]
    assert not probe.contains(key(3))
    assert probe.shared.status()["fs_ops"] - before == 4


def test_another_nodes_bad_file_is_a_miss_and_left_alone(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    a.put(key(4), payload(4))
    path = a.path_for(key(4))
    corrupt_file(path, "flip")
    before = path.read_bytes()
    buf = bytearray(len(payload(4)))
    assert not b.read_into(key(4), buf)
    assert b.stats.foreign_failures == 1
    assert path.read_bytes() == before  # B neither moved nor repaired A's file
    # A's own read quarantines it (the owner's job), so A's check stays clean.
    assert not a.read_into(key(4), buf)
    assert not path.exists()


def test_a_file_replaced_by_another_keys_file_is_never_served(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    a.put(key(5), payload(5))
    a.put(key(6), payload(6, size=8192))
    # A stale or overwritten view: the name of key 5 holds key 6's (valid) file.
    os.replace(a.path_for(key(6)), a.path_for(key(5)))
    a.index.remove(key(6))
    buf = bytearray(8192)
    assert not b.read_into(key(5), buf)
    assert b.stats.load_hits == 0
    assert not a.read_into(key(5), buf)  # the owner quarantines it


def test_each_node_holds_its_own_cap_so_the_tree_holds_the_sum(tmp_path: Path) -> None:
    size = HEADER_SIZE + 8192
    a, b = node(tmp_path, "a", capacity=3 * size), node(tmp_path, "b", capacity=3 * size)
    outcomes = [a.put(key(10 + i), payload(10 + i)) for i in range(5)]
    outcomes += [b.put(key(20 + i), payload(20 + i)) for i in range(5)]
    assert outcomes.count("stored") == 6
    on_disk = sum(p.stat().st_size for p in (tmp_path / "nodes").rglob("*.kvp"))
    assert on_disk == 6 * size == a.capacity_bytes + b.capacity_bytes


def test_one_writer_per_node_part_and_the_holder_is_named(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    with pytest.raises(RootLockedError, match="KVP_NODE_ID"):
        KvFileStore(tmp_path / "nodes" / "a", 10**9, shared_tree=tmp_path).open(
            background_scan=False)
    holder = root_lock_holder(a.root)
    assert holder is not None and holder.startswith(f"{os.getpid()}@")
    assert root_lock_holder(tmp_path / "nodes" / "nobody") is None
    b = node(tmp_path, "b")  # another node's part is another root
    assert root_lock_holder(b.root) is not None


def test_other_parts_are_probed_only_up_to_the_first_key_nobody_has(tmp_path: Path) -> None:
    nodes = [node(tmp_path, f"n{i}") for i in range(4)]
    nodes[1].put(key(30), payload(30))
    nodes[2].put(key(31), payload(31))
    probe = nodes[0]
    probe.put(key(35), payload(35))
    assert probe.shared is not None
    probe.shared.other_parts()
    before = probe.shared.status()["fs_ops"]
    request = [key(30), key(31), key(32), key(33), key(34), key(35)]
    assert probe.contains_many(request) == [True, True, False, False, False, True]
    # key 30: found in the first other part (1 stat), key 31 in the second (2), key 32 in none
    # (3); keys 33-34 are not probed; key 35 is this node's own (no stat).
    assert probe.shared.status()["fs_ops"] - before == 1 + 2 + 3


def test_the_first_gap_is_per_rank_row_so_one_rank_s_new_tail_hides_no_other_rank(
        tmp_path: Path) -> None:
    """At TP=2 LMCache asks rank 0's row, then rank 1's, in one flattened list.  A follow-up
    prompt's new tail is a gap at the end of rank 0's row; rank 1's stored prefix after it must
    still be probed and found (it was reported missing: 0 cross-node hits at TP >= 2)."""
    writer, reader = node(tmp_path, "a"), node(tmp_path, "b")

    def ranked(i: int, rank: int) -> KeyFields:
        return key(i)._replace(kv_rank=0x02000200 + rank * 0x00010001)

    for rank in (0, 1):
        for i in (40, 41):
            assert writer.put(ranked(i, rank), payload(i)) == "stored"
    request = [ranked(i, rank) for rank in (0, 1) for i in (40, 41, 42)]
    assert reader.contains_many(request) == [True, True, False, True, True, False]
    # another object group is its own row too
    grouped = [ranked(40, 0), ranked(42, 0), ranked(40, 0)._replace(object_group_id=1)]
    writer.put(grouped[2], payload(40))
    assert reader.contains_many(grouped) == [True, False, True]
