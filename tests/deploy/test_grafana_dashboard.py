"""The Grafana dashboard asks only for metrics that exist: every metric name in its queries is one
the live server (relayed by ``kvp-admin metrics``), ``kvp-admin metrics`` itself, or the
connector's vLLM metrics class exports.  The panels the operators asked for are all there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpersist.config.server import load_settings
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import clear_l1, server_env, wait_for_l2_files
from kvpersist.testing.lmcache_bench import BenchDriver

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "configs" / "grafana" / "kvpersist.json"
PANELS = ("Hit ratio from L2", "Restored from L2", "L2 bytes against budget, per namespace",
          "Rejected stores by reason", "Verification failures", "Quarantine", "Evictions",
          "Lookup bypasses (vLLM)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, aggregation
    keywords or label names."""
    text = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        names.add(match.group())
    return names


def exported_families(prometheus_text: str) -> set[str]:
    return {line.split()[2] for line in prometheus_text.splitlines()
            if line.startswith("# TYPE ")}


def queries() -> dict[str, list[str]]:
    data = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in data["panels"]}


def test_metric_names_are_parsed_from_promql() -> None:
    assert metric_names('sum by (reason) (rate(vllm:x_total{a="b"}[5m])) / clamp_min(y, 1)') \
        == {"vllm:x_total", "y"}


def test_the_requested_panels_are_there() -> None:
    found = queries()
    for title in PANELS:
        assert found.get(title), f"panel {title!r} missing or without a query"


def _vllm_families() -> set[str]:
    """What the connector's metrics class registers, with prometheus_client's own types (vLLM
    hands it wrappers of these); the live counter is asserted in test_service_down_e2e.py."""
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvpersist.serving.connector.metrics import KvPersistPromMetrics

    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KvPersistPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe({"kvpersist_bypasses": {"stalled": 1}}, 0)
    return exported_families(prometheus_client.generate_latest(registry).decode())


@pytest.mark.integration
def test_every_queried_metric_is_exported(tmp_path: Path) -> None:
    env = server_env(tmp_path / "cache")
    settings = load_settings(env)
    start_server(settings)
    try:
        driver = BenchDriver(settings.request_url, settings.http_url, "org/dash/kvp-" + "a" * 32)
        sums = driver.checksums(0)
        assert driver.store(0)
        wait_for_l2_files(settings.cache_root, 4)
        clear_l1(settings)
        assert driver.lookup_and_retrieve(0, sums).hit_chunks == 4  # lookup counters exist now
        driver.close()
        admin = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "metrics"],
                               env={**os.environ, **env}, capture_output=True, text=True,
                               timeout=120)
        assert admin.returncode == 0, admin.stderr
    finally:
        stop_server(settings)
    exported = exported_families(admin.stdout) | _vllm_families()
    assert "kvpersist_server_up 1" in admin.stdout  # the relay read the live server
    used = {name for exprs in queries().values() for e in exprs for name in metric_names(e)}
    assert used, "no metric names found in the dashboard"
    assert sorted(used - exported) == [], f"queried but not exported: {sorted(used - exported)}"
