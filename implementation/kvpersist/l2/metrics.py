"""The L2 store's counters as Prometheus metrics of the LMCache server (``/metrics``).

Observable instruments (:mod:`kvpersist.observed_metrics`) on the LMCache server's own
``/metrics`` page.

Invariants
----------
* Every value is read from :meth:`KvFileStore.status` at scrape time: nothing is counted twice
  and nothing here can fall out of step with ``/status``.
* The Grafana dashboard's test checks the names its queries use against a live server's page.
* Without OpenTelemetry installed, registering is a no-op (metrics are optional, data is not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..observed_metrics import ObservedMetrics, by_label, field, fields

METER = "kvpersist.l2"

_METRICS = ObservedMetrics(METER, "the store status", counters={
    "kvpersist_l2.stores": ("Objects published to L2", field("stores")),
    "kvpersist_l2.stored_bytes": ("Bytes published to L2", field("stored_bytes")),
    "kvpersist_l2.rejected_stores": ("Stores refused, by reason", fields({
        "rejected_capacity": {"reason": "capacity"},
        "rejected_scanning": {"reason": "scanning"},
        "rejected_disk_full": {"reason": "disk_full"},
        "store_errors": {"reason": "error"},
        "store_lease_expired": {"reason": "lease_expired"}})),
    "kvpersist_l2.loads": ("Objects asked of L2, by result", fields({
        "load_hits": {"result": "hit"}, "load_misses": {"result": "miss"}})),
    "kvpersist_l2.loaded_bytes": ("Verified bytes loaded from L2 into L1",
                                  field("loaded_bytes")),
    "kvpersist_l2.verify_failures": ("Reads that failed the check", field("verify_failures")),
    "kvpersist_l2.quarantined": ("Files moved to quarantine", field("quarantined")),
    "kvpersist_l2.evicted": ("Files evicted by the budget", field("evicted")),
    "kvpersist_l2.io_errors": (
        "Reads and deletions that failed for another reason than absence or the file's check "
        "(the file and its count left as they were), by operation", fields({
            "read_errors": {"op": "read"}, "delete_errors": {"op": "delete"}})),
    "kvpersist_l2.migrated_names": ("Files of an earlier version's ambiguous names renamed "
                                    "at start", field("migrated_names")),
    "kvpersist_l2.verify_failures_by_reason": (
        "Reads that failed the check, by reason (a series once a reason occurred)",
        by_label("verify_failures_by_reason", "reason")),
}, gauges={
    "kvpersist_l2.used_bytes": ("Bytes of published L2 files", field("used_bytes")),
    "kvpersist_l2.capacity_bytes": ("The L2 budget (hard cap)", field("capacity_bytes")),
    "kvpersist_l2.files": ("Published L2 files", field("files")),
    "kvpersist_l2.quarantine_files": ("Files in quarantine now", field("quarantine_files")),
    "kvpersist_l2.quarantine_bytes": ("Bytes in quarantine now (they count against the cap)",
                                      field("quarantine_bytes")),
    # several roots (KVP_CACHE_EXTRA_ROOTS): one series per root, labelled with its path
    "kvpersist_l2.root_used_bytes": ("Bytes of published L2 files, by root",
                                     by_label("root_used_bytes", "root")),
    "kvpersist_l2.root_capacity_bytes": ("A root's share of the budget, by root",
                                         by_label("root_capacity_bytes", "root")),
    "kvpersist_l2.root_files": ("Published L2 files, by root", by_label("root_files", "root")),
    "kvpersist_l2.root_degraded": ("1 while a root is given up (its device failed, vanished "
                                   "or turned read-only; its chunks miss), by root",
                                   by_label("root_degraded", "root")),
})


def bind(status: Callable[[], dict[str, Any]] | None) -> bool:
    """Make the metrics read ``status()`` (None: report nothing).  The instruments are created
    once per process; False when OpenTelemetry is not installed."""
    return _METRICS.bind(status)
