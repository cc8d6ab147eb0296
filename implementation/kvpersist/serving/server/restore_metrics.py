"""The L1 window's counters on the LMCache server's ``/metrics`` (observable instruments,
:mod:`kvpersist.observed_metrics`, as :mod:`kvpersist.l2.metrics` has for the store).

Prometheus names (the exporter adds ``_total``): ``kvpersist_restore_streamed`` (restores that
streamed through L1), ``kvpersist_restore_streamed_chunks`` / ``..._streamed_bytes``,
``kvpersist_restore_evicted_on_demand`` / ``..._evicted_on_demand_bytes`` (clean L1 objects
evicted to make room), ``kvpersist_restore_released_abandoned`` (abandoned lookups settled in
the background), and ``kvpersist_restore_cut_short{reason}`` with
``kvpersist_restore_cut_short_tokens{reason}``: restores that delivered less than the prefix L1
and L2 held, by reason (``l1_full``: L1 could not take it even after evicting clean objects;
``load_failed``: a file did not load or verify; ``stream_failed``: a streamed window did not).
Beside them, ``kvpersist_l1_stores_dropped`` / ``..._bytes``: chunks of STOREs that L1 could not
take even after evicting clean objects (L2 behind the engine); LMCache skips them without an
error and vLLM counts them as stored, so this is the only count of KV never written.

Invariant: values are read from the window's snapshot at scrape time; nothing is counted here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...observed_metrics import ObservedMetrics, by_label, field

METER = "kvpersist.restore"

_METRICS = ObservedMetrics(METER, "the restore counters", counters={
    "kvpersist_restore.streamed": ("Restores that streamed through L1",
                                   field("streamed_restores")),
    "kvpersist_restore.streamed_chunks": ("Chunks loaded by streamed windows",
                                          field("streamed_columns")),
    "kvpersist_restore.streamed_bytes": ("Bytes loaded by streamed windows",
                                         field("streamed_bytes")),
    "kvpersist_restore.evicted_on_demand": ("Clean L1 objects evicted to make room",
                                            field("evicted_objects")),
    "kvpersist_restore.evicted_on_demand_bytes": ("Bytes of clean L1 objects evicted",
                                                  field("evicted_bytes")),
    "kvpersist_restore.released_abandoned": ("Abandoned lookups released when their load ended",
                                             field("released_abandoned")),
    "kvpersist_l1.stores_dropped": ("Chunks of STOREs L1 could not take (not written to L2)",
                                    field("stores_dropped")),
    "kvpersist_l1.stores_dropped_bytes": ("Bytes of STOREs L1 could not take",
                                          field("stores_dropped_bytes")),
    "kvpersist_restore.cut_short": ("Restores that got less than the prefix L1 and L2 held",
                                    by_label("cut_short", "reason")),
    "kvpersist_restore.cut_short_tokens": ("Tokens recomputed by restores cut short",
                                           by_label("cut_short_tokens", "reason")),
})


def bind(snapshot: Callable[[], dict[str, Any]]) -> bool:
    """Make the instruments read ``snapshot()``; False without OpenTelemetry."""
    return _METRICS.bind(snapshot)
