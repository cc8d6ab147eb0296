"""How long lookups and stores wait while ``/cache/objects`` is paged, at a million keys.

A thread pages the index (the first page sorts every key by file name) while another takes the
index lock the way every lookup and store does (``key in index``, ``touch``) in a tight loop and
records each wait.  Prints the sort's time and the longest and 99th-percentile waits, side by
side with the same run when the sort held the lock (the behaviour before issue 35)::

    .venv/bin/python benchmarks/bench_index_listing.py --keys 1000000
"""

from __future__ import annotations

import argparse
import threading
import time

from kvpersist.l2.index import KeyIndex
from kvpersist.l2.layout import KeyFields, format_name


def waits_while_listing(index: KeyIndex, keys: list[KeyFields], *, sort_under_lock: bool
                        ) -> tuple[float, list[float]]:
    waits: list[float] = []
    done = threading.Event()

    def lookups() -> None:
        i = 0
        while not done.is_set():
            began = time.perf_counter()
            index.touch(keys[i % len(keys)])
            waits.append(time.perf_counter() - began)
            i += 1

    worker = threading.Thread(target=lookups)
    worker.start()
    time.sleep(0.2)
    began = time.perf_counter()
    if sort_under_lock:  # what page() did before: sort every key inside the lock
        with index._lock:
            sorted(index._sizes, key=format_name)
    else:
        index._sorted = None
        index.page(None, 0, 1000)
    took = time.perf_counter() - began
    done.set()
    worker.join()
    return took, waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys in the index")
    args = parser.parse_args()
    keys = [KeyFields(f"org/model/kvp-{'a' * 32}", 0x01000100, 0, i.to_bytes(32, "big"))
            for i in range(args.keys)]
    index = KeyIndex(10**15)
    index.mark_complete()
    index.add((k, 4096 + 16 * 2**20) for k in keys)
    for label, under_lock in (("sort inside the lock (before)", True),
                              ("sort outside the lock (now)", False)):
        took, waits = waits_while_listing(index, keys, sort_under_lock=under_lock)
        waits.sort()
        p99 = waits[int(len(waits) * 0.99)] if waits else 0.0
        print(f"{label:32s} listing {took:6.2f} s; lookups waited at most "
              f"{waits[-1] * 1e3:8.1f} ms (p99 {p99 * 1e3:.3f} ms, {len(waits)} lookups)")


if __name__ == "__main__":
    main()
