"""kvp-admin against a live LMCache server with the kvpersist adapter: status and report agree
with the server's counters; cleanup --apply of a stale namespace while the server runs goes
through the server, keeps its accounting right, and leaves the active namespace readable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import adapter_status as adapter
from kvpersist.testing.helpers import (
    clear_l1,
    l2_files,
    server_env,
    wait_for_l2_files,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver

pytestmark = pytest.mark.integration
NS_A, NS_B = "kvp-" + "a" * 32, "kvp-" + "b" * 32


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerSettings]:
    values = server_env(tmp_path / "cache", KVP_L2_ADAPTER="kvpersist")
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    s = load_settings(values)
    yield s
    stop_server(s)


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    assert code in (0, 3), out
    return dict(json.loads(out))


def test_status_report_cleanup_with_live_server(env: ServerSettings,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = env.cache_root
    start_server(env)
    zmq = env.request_url
    stale = BenchDriver(zmq, env.http_url, f"org/old/{NS_B}")
    stale.store(5)
    wait_for_l2_files(root, 4)
    stale.close()
    active = BenchDriver(zmq, env.http_url, f"org/new/{NS_A}")
    sums = active.checksums(6)
    assert active.store(6)
    wait_for_l2_files(root, 8)

    status = cli_json(capsys, "status")
    assert status["healthy"] is True and status["pid_state"] == "running"
    report = cli_json(capsys, "report")  # active namespaces asked from the running server
    assert report["active_source"] == "server" and report["active_namespaces"] == [NS_A]
    rows = {r["namespace"]: r for r in report["namespaces"]}  # type: ignore[attr-defined]
    server_used = adapter(env)["used_bytes"]
    assert report["classes"]["live"]["bytes"] == server_used  # type: ignore[index]
    assert rows[NS_A]["files"] == rows[NS_B]["files"] == 4
    assert rows[NS_B]["state"] == "stale"

    result = cli_json(capsys, "cleanup", "--apply")
    assert result["deleted_files"] == 4 and result["via_server"] == 4
    # the server's index drops the deleted keys (its byte count is checked below)
    wait_until(lambda: adapter(env)["files"] == 4,
               message="the server's index still counts the deleted files")
    names = l2_files(root, (".kvp",))
    assert len(names) == 4 and all(NS_A in n for n in names)
    assert adapter(env)["used_bytes"] == sum(p.stat().st_size for p in root.glob("*.kvp"))

    # the active namespace is intact and readable from L2
    clear_l1(env)
    trip = active.lookup_and_retrieve(6, sums)
    assert (trip.hit_chunks, trip.retrieved_ok, trip.checksums_match) == (4, True, True)
    active.close()
