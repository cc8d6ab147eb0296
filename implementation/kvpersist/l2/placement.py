"""Which root (device) a chunk's file lives on: rendezvous hashing of the file name.

Invariants
----------
* :func:`place` is a pure function of the key's file name and the roots' names (their
  configured paths): every process and every restart with the same roots puts a key on the same
  root, so a lookup goes straight to one device, with no search.
* Highest random weight: adding a root moves only the keys that now rank it first (about
  1/(N+1) of them), all to the new root; removing a root moves only its own keys.  A key found
  on a root that is no longer its first choice is still served (the store set looks in the other
  roots' indexes, in memory), so a change of roots costs misses of moved keys at most, never a
  wrong hit or a key counted twice.
* Keys spread evenly: each root gets a share of ``1/N`` of the keys of every namespace, within
  the binomial spread of the hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .layout import KeyFields, format_name


def _score(name: bytes, root: str) -> int:
    digest = hashlib.blake2b(root.encode() + b"\0" + name, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: KeyFields, roots: Sequence[str]) -> list[int]:
    """Indexes of ``roots`` in the order ``key`` prefers them (its placement first)."""
    if not roots:
        raise ValueError("no roots to place a key on")
    name = format_name(key).encode()
    scores = [(_score(name, root), i) for i, root in enumerate(roots)]
    return [i for _, i in sorted(scores, reverse=True)]


def place(key: KeyFields, roots: Sequence[str]) -> int:
    """The index in ``roots`` of the root that holds ``key``'s file."""
    if len(roots) == 1:
        return 0
    name = format_name(key).encode()
    return max(range(len(roots)), key=lambda i: _score(name, roots[i]))
