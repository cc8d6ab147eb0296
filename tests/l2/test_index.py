"""The index's bookkeeping without I/O: adopting a start-up scan in one step."""

from __future__ import annotations

import pytest

from kvpersist.l2.index import KeyIndex
from kvpersist.l2.layout import KeyFields


def key(i: int) -> KeyFields:
    return KeyFields("org/model/kvp-" + "d" * 32, 0x01000100, 0, i.to_bytes(32, "big"))


def test_an_adopted_scan_keeps_what_lookups_found_meanwhile_counted_once() -> None:
    announced: list[tuple[list[KeyFields], list[int]]] = []
    index = KeyIndex(10**9, on_added=lambda keys, sizes: announced.append((keys, sizes)))
    # lookups during the scan found keys 2 and 7 on disk (7 is not in the scan: created after
    # the walk read its directory)
    index.add([(key(2), 20), (key(7), 70)])
    announced.clear()
    scanned = {key(i): 10 * i for i in range(5)}
    assert index.adopt_scan(scanned) == 4
    keys, sizes, reserved = index.ordered()
    assert keys == [key(0), key(1), key(3), key(4), key(2), key(7)]  # scanned LRU order first
    assert sizes == [0, 10, 30, 40, 20, 70]
    assert index.used_bytes == sum(sizes) and reserved == 0
    assert announced == [([key(0), key(1), key(3), key(4)], [0, 10, 30, 40])]


def test_a_scan_is_adopted_only_while_the_index_is_incomplete() -> None:
    index = KeyIndex(10**9)
    assert index.adopt_scan({key(1): 5}) == 1
    index.mark_complete()
    with pytest.raises(RuntimeError, match="complete"):
        index.adopt_scan({key(2): 5})
    assert len(index) == 1 and index.used_bytes == 5


def test_an_empty_scan_adds_nothing_and_announces_nothing() -> None:
    announced: list[object] = []
    index = KeyIndex(10**9, on_added=lambda keys, sizes: announced.append(keys))
    index.add([(key(1), 3)])
    announced.clear()
    assert index.adopt_scan({key(1): 3}) == 0
    assert announced == [] and index.used_bytes == 3 and len(index) == 1


def test_listing_sorts_outside_the_lock_every_lookup_and_store_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Paging ``/cache/objects`` sorts every key (seconds at a million keys): the sort's key
    function never runs under the index lock, so lookups and stores wait at most for a copy of
    the keys and one page (issue 35; benchmarks/bench_index_listing.py measures the wait)."""
    from kvpersist.l2 import index as index_module

    index = KeyIndex(10**12)
    index.mark_complete()
    index.add((KeyFields("org/m/kvp-" + "e" * 32, 0, 0, i.to_bytes(32, "big")), 10)
              for i in range(500))
    held: list[bool] = []
    real = index_module.format_name

    def watching(key: KeyFields) -> str:
        held.append(index._lock.locked())
        return real(key)

    monkeypatch.setattr(index_module, "format_name", watching)
    page, nxt = index.page(None, 0, 100)
    assert len(page) == 100 and nxt == 100 and len(held) == 500 and not any(held)
    held.clear()
    assert index.page(None, 100, 100)[0] != page and held == []  # sorted once, until a change
