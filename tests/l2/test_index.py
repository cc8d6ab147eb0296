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
