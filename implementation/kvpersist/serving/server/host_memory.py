"""Does L1 fit in the host's memory?  LMCache allocates ``KVP_L1_SIZE_GB`` in full at start; a
size above what the host has available ends in the OOM killer (the server, or vLLM beside it)
instead of an error.

Invariant: :func:`l1_refusal` answers a fix-it message when L1 exceeds ``MemAvailable`` (the
kernel's estimate of what can be allocated without swapping, :func:`mem_available_bytes`), else
None; a host that does not report it (no ``/proc/meminfo``) is not refused.
"""

from __future__ import annotations

from pathlib import Path

from ...config.server import ServerSettings

MEMINFO = Path("/proc/meminfo")


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def l1_refusal(settings: ServerSettings, available: int | None) -> str | None:
    """Why L1 cannot be allocated on a host with ``available`` bytes
    (:func:`mem_available_bytes`), or None."""
    l1 = settings.l1_size_gb * 2**30
    if available is None or l1 <= available:
        return None
    return (f"KVP_L1_SIZE_GB={settings.l1_size_gb:g} is more than the {available / 2**30:.1f} GiB "
            "this host has available (MemAvailable); LMCache allocates L1 in full at start. "
            "Lower KVP_L1_SIZE_GB, leaving room for vLLM's own memory (docs/sizing.md)")
