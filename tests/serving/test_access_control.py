"""Only the cache's owner gets in: a real second account (uid 65534 through ``setpriv``) against
a real server.

The other account runs :mod:`kvpersist.testing.foreign_client` with the system's ``python3``
(it cannot reach this checkout's virtual environment).  Every LOOKUP, STORE and RETRIEVE is a
message on a connection to the request endpoint, so "the endpoint refuses the connection" is the
refusal of all three; the admin operations are sent as real HTTP requests.

The cache lives under a world-traversable directory, so nothing but the server's own access
control stands between the other account and the endpoints; the opt-in ``tcp`` mode (the
behaviour before access control) and a configured group show the same client getting through.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving import http
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import foreign_client
from kvpersist.testing.helpers import clear_l1, server_env, tcp_listeners, wait_for_l2_files
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.processes import server_pid

pytestmark = pytest.mark.integration

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
MODEL = "org/access-test/kvp-" + "c" * 32


def _other_account_can_run_python() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON):
        return False
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            SYSTEM_PYTHON, "-c", "pass"], capture_output=True, timeout=30)
    return probe.returncode == 0


requires_second_account = pytest.mark.skipif(
    not _other_account_can_run_python(),
    reason="needs root, setpriv and a system python3 that uid 65534 may run")


@pytest.fixture
def public_base() -> Iterator[Path]:
    """A directory every account may traverse (0755), under a traversable /tmp."""
    base = Path(tempfile.mkdtemp(prefix="kvp-acl-", dir="/tmp"))
    base.chmod(0o755)
    shutil.copy(foreign_client.__file__, base / "foreign_client.py")
    shutil.copy(http.__file__, base / "kvp_http.py")  # kvpersist's client: standard library only
    for name in ("foreign_client.py", "kvp_http.py"):
        (base / name).chmod(0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def run_client(base: Path, settings: ServerSettings, ops: list[str], *, as_nobody: bool,
               gid: int = NOBODY, groups: str = "--clear-groups",
               keys: list[str] | None = None) -> dict[str, Any]:
    cmd = [SYSTEM_PYTHON, str(base / "foreign_client.py"), "--http", settings.http_url,
           "--request", settings.request_url, "--keys", json.dumps(keys or []), *ops]
    if as_nobody:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={gid}", groups, *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=base)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (sockets and the log aside) by relative path -> sha256."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_socket() and path.suffix != ".log":
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@requires_second_account
def test_other_account_is_refused_everything(public_base: Path) -> None:
    settings = load_settings(server_env(public_base / "cache"))
    assert settings.access == "unix"
    start_server(settings)
    try:
        assert tcp_listeners(server_pid(settings)) == []
        owner = BenchDriver(settings.request_url, settings.http_url, MODEL)
        try:
            sums = owner.checksums(0)
            assert owner.store(0)
            wait_for_l2_files(settings.cache_root, 1)
            listed = http.get(settings.http_url + "/cache/objects", timeout=10).json()["entries"]
            keys = [e["key"] for e in listed]
            assert keys
            before = tree_digest(settings.cache_root)

            attack = run_client(public_base, settings,
                                ["request", "healthcheck", "list", "delete", "clear"],
                                as_nobody=True, keys=keys)
            for op, result in attack.items():
                assert "denied" in result and "Permission denied" in result["denied"], (op, result)

            # kvpersist's own HTTP client (what the connector's gate uses) says why, at once
            said = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 SYSTEM_PYTHON, "-c", "import sys, kvp_http\n"
                 "try:\n    kvp_http.get(sys.argv[1] + '/healthcheck', timeout=5)\n"
                 "except kvp_http.AccessDenied as exc:\n    print(exc)\n", settings.http_url],
                capture_output=True, text=True, timeout=60, cwd=public_base)
            assert "this account may not use the cache server" in said.stdout, said

            assert tree_digest(settings.cache_root) == before, "the other account changed files"
            clear_l1(settings)  # the owner's restore must come from L2
            trip = owner.lookup_and_retrieve(0, sums)
            assert trip.hit_chunks == trip.total_chunks > 0
            assert trip.retrieved_ok and trip.checksums_match
        finally:
            owner.close()

        # the same client, run by the owner, gets through
        mine = run_client(public_base, settings, ["request", "healthcheck", "list"],
                          as_nobody=False)
        assert mine["request"] == {"connected": True}
        assert mine["healthcheck"]["status"] == 200 and mine["list"]["status"] == 200
    finally:
        stop_server(settings)
    assert not settings.http_socket.exists() and not settings.request_socket.exists()


@requires_second_account
def test_tcp_opt_in_is_open_to_every_account(public_base: Path) -> None:
    """What the default protects against: with ``KVP_ACCESS=tcp`` the other account lists the
    cache and reaches the request port."""
    settings = load_settings(server_env(public_base / "cache", KVP_ACCESS="tcp"))
    result = start_server(settings)
    try:
        assert result.warning is not None and "without access control" in result.warning
        listeners = tcp_listeners(server_pid(settings))
        assert len(listeners) >= 2
        assert all(addr.startswith("0100007F:") for addr in listeners), listeners  # 127.0.0.1
        got = run_client(public_base, settings, ["request", "list"], as_nobody=True)
        assert got["request"] == {"connected": True}
        assert got["list"]["status"] == 200 and "entries" in got["list"]["body"]
    finally:
        stop_server(settings)


@requires_second_account
def test_configured_group_gets_in(public_base: Path) -> None:
    run = public_base / "run"
    settings = load_settings(server_env(public_base / "cache", KVP_ACCESS_GROUP="nogroup",
                                        KVP_RUNTIME_DIR=str(run)))
    start_server(settings)
    try:
        assert (run.stat().st_mode & 0o777) == 0o750 and run.stat().st_gid == NOBODY
        for sock in (settings.http_socket, settings.request_socket):
            assert (sock.stat().st_mode & 0o777) == 0o660 and sock.stat().st_gid == NOBODY
        assert (settings.cache_root.stat().st_mode & 0o777) == 0o700
        member = run_client(public_base, settings, ["request", "healthcheck"], as_nobody=True)
        assert member["request"] == {"connected": True}
        assert member["healthcheck"]["status"] == 200
        outsider = run_client(public_base, settings, ["request", "healthcheck"], as_nobody=True,
                              gid=100)
        assert all("denied" in r for r in outsider.values()), outsider
    finally:
        stop_server(settings)
