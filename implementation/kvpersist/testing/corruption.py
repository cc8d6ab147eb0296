"""The one corruption helper of the test suites: ways to damage a published cache file, each with
the verification failure the read check must report for it.

Invariant: every kind leaves a file that must never be served; ``EXPECTED_REASON`` says which
check catches it (the first that fails in :func:`kvpersist.l2.files.read_verified`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..l2.format import HEADER_SIZE

#: kind → the reason tag the read check reports.
EXPECTED_REASON: dict[str, str] = {
    "noise": "payload-checksum",  # same size, plausible float bytes: the dangerous case
    "random": "payload-checksum",
    "flip": "payload-checksum",  # one bit of the payload
    "half": "size-mismatch",
    "zero": "short-header",
    "header": "header-checksum",
    "other-key": "key-mismatch",  # a valid file of another chunk in its place
    "other-namespace": "key-mismatch",  # the same chunk of another namespace in its place
}
NEEDS_DONOR = ("other-key", "other-namespace")


def corrupt_bytes(raw: bytes, how: str, donor: bytes | None = None) -> bytes:
    """The damaged version of a cache file's bytes ``raw``."""
    out = bytearray(raw)
    if how == "noise":
        out[HEADER_SIZE:] = bytes(reversed(out[HEADER_SIZE:]))
    elif how == "random":
        out[HEADER_SIZE:] = os.urandom(len(out) - HEADER_SIZE)
    elif how == "flip":
        out[HEADER_SIZE + 17] ^= 0x40
    elif how == "half":
        out = out[: len(out) // 2]
    elif how == "zero":
        out = bytearray()
    elif how == "header":
        out[40:48] = bytes(b ^ 0xFF for b in out[40:48])
    elif how in NEEDS_DONOR:
        if donor is None:
            raise ValueError(f"corruption {how!r} needs the bytes of a donor file")
        out = bytearray(donor)
    else:
        raise ValueError(f"unknown corruption {how!r}; one of {', '.join(EXPECTED_REASON)}")
    if bytes(out) == raw:
        raise ValueError(f"corruption {how!r} left the file unchanged")
    return bytes(out)


def corrupt_file(path: Path, how: str, donor: Path | bytes | None = None) -> None:
    """Damage ``path`` in place (``donor``: the file or bytes put there by the donor kinds)."""
    donor_bytes = donor.read_bytes() if isinstance(donor, Path) else donor
    path.write_bytes(corrupt_bytes(path.read_bytes(), how, donor_bytes))
