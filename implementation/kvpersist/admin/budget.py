"""The budget model: hard cap, physical ceiling, eviction thresholds, per-namespace quotas.

Invariants
----------
* All arithmetic is in bytes (GiB = 1024**3, as LMCache's ``max_capacity_gb``).
* The reclaim target is ``cap × watermark × (1 − ratio)`` (≈ 0.81 of the cap with the defaults):
  where LRU eviction brings usage back to once it passes the watermark.
* The physical ceiling is what the device can hold for the cache: its free space plus the bytes
  the cache already occupies there.  A budget above the ceiling is a promise the disk cannot keep.
* Usage is always measured from the disk (:mod:`kvpersist.l2.inventory`), never from a server counter.
* A quotas file is validated completely before it is used or written; an invalid file is an error
  naming the problem, never partly applied.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_text_atomic
from ..identity import NAMESPACE_RE

GIB = 1024**3
QUOTAS_VERSION = 1


class QuotaError(ValueError):
    """The quotas file or a quota value is invalid."""


@dataclass(frozen=True)
class BudgetModel:
    cap_bytes: int
    watermark: float = 0.9
    ratio: float = 0.1

    @classmethod
    def from_gb(cls, budget_gb: float, watermark: float = 0.9, ratio: float = 0.1) -> BudgetModel:
        return cls(int(budget_gb * GIB), watermark, ratio)

    @property
    def trigger_bytes(self) -> int:
        return int(self.cap_bytes * self.watermark)

    @property
    def reclaim_target_bytes(self) -> int:
        return int(self.cap_bytes * self.watermark * (1 - self.ratio))

    def share(self, nbytes: int) -> float:
        return nbytes / self.cap_bytes if self.cap_bytes else math.inf


@dataclass(frozen=True)
class CeilingCheck:
    ok: bool
    free_bytes: int
    cache_bytes: int
    ceiling_bytes: int
    cap_bytes: int
    device: str

    def message(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        if self.ok:
            return (f"the device of {self.device} can hold the budget: ceiling {gib(self.ceiling_bytes)}"
                    f" (free {gib(self.free_bytes)} + cache {gib(self.cache_bytes)}) ≥ cap "
                    f"{gib(self.cap_bytes)}")
        return (f"budget {gib(self.cap_bytes)} exceeds what the device of {self.device} can hold: "
                f"free {gib(self.free_bytes)} + cache {gib(self.cache_bytes)} = "
                f"{gib(self.ceiling_bytes)}. Lower KVP_CACHE_BUDGET_GB to at most "
                f"{self.ceiling_bytes / GIB:.0f} or free space on the device")


def device_ceiling(root: Path, cache_bytes: int, cap_bytes: int,
                   device: Path | None = None) -> CeilingCheck:
    """Check ``cap_bytes`` against free space of ``device`` (default: ``root``) + cache bytes."""
    where = device or root
    free = shutil.disk_usage(where).free
    ceiling = free + cache_bytes
    return CeilingCheck(ceiling >= cap_bytes, free, cache_bytes, ceiling, cap_bytes, str(where))


# --------------------------------------------------------------------------- quotas


def validate_quotas(data: object, *, source: str = "quotas.json") -> dict[str, int]:
    """``{"version": 1, "quotas": {namespace: GiB}}`` → namespace → bytes, or QuotaError."""
    if not isinstance(data, Mapping):
        raise QuotaError(f"{source}: expected a JSON object with 'version' and 'quotas'")
    unknown = sorted(set(data) - {"version", "quotas"})
    if unknown:
        raise QuotaError(f"{source}: unknown key(s) {unknown}; allowed: 'version', 'quotas'")
    if data.get("version", QUOTAS_VERSION) != QUOTAS_VERSION:
        raise QuotaError(f"{source}: unsupported version {data.get('version')!r}; expected 1")
    quotas = data.get("quotas", {})
    if not isinstance(quotas, Mapping):
        raise QuotaError(f"{source}: 'quotas' must be an object of namespace → GiB")
    out: dict[str, int] = {}
    for ns, gb in quotas.items():
        out[check_namespace(ns, source)] = quota_bytes(gb, f"{source}: quota of {ns}")
    return out


def check_namespace(ns: object, source: str = "namespace") -> str:
    if not isinstance(ns, str) or not NAMESPACE_RE.match(ns):
        raise QuotaError(f"{source}: {ns!r} is not a namespace (kvp- followed by 32 hex digits; "
                         "see `kvp-admin report`)")
    return ns


def quota_bytes(gb: object, what: str) -> int:
    if isinstance(gb, bool) or not isinstance(gb, (int, float)):
        raise QuotaError(f"{what} must be a number of GiB, got {gb!r}")
    if not math.isfinite(gb) or gb < 0:
        raise QuotaError(f"{what} must be a non-negative number of GiB, got {gb!r}")
    return int(gb * GIB)


def load_quotas(path: Path) -> dict[str, int]:
    """Quotas in bytes; a missing file means no quotas."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise QuotaError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuotaError(f"{path} is not valid JSON: {exc}") from None
    return validate_quotas(data, source=str(path))


def save_quotas(path: Path, quotas_bytes: Mapping[str, int]) -> None:
    """Validate and atomically write quotas (GiB in the file)."""
    body = {"version": QUOTAS_VERSION,
            "quotas": {ns: quotas_bytes[ns] / GIB for ns in sorted(quotas_bytes)}}
    validate_quotas(body, source=str(path))
    write_text_atomic(path, json.dumps(body, indent=2, sort_keys=True) + "\n")


def over_quota(usage: Mapping[str, int], quotas: Mapping[str, int]) -> dict[str, int]:
    """Namespace → bytes above its quota (only namespaces that are over)."""
    return {ns: usage.get(ns, 0) - q for ns, q in quotas.items() if usage.get(ns, 0) > q}
