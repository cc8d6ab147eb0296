"""kvpersist as a user installs it: a wheel in a fresh venv outside the checkout.

The venv gets the wheel alone (``--no-deps``); NumPy, xxhash and LMCache come from the project's
environment through a ``.pth`` line, which adds that site-packages *after* the wheel's and
without its editable-install hooks, so ``kvpersist`` can only be the wheel's copy.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpersist.demo.stack import free_port
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.helpers import key_of

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out / "dist"), str(REPO)], check=True, cwd=out)
    wheel = next((out / "dist").glob("kvpersist-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for data in ("kvpersist/config/templates/kvpersist.env",
                 "kvpersist/config/templates/l2-adapters.json",
                 "kvpersist/demo/tiny-llama/identity.env", "kvpersist/py.typed"):
        assert data in names, f"{data} is not package data of the wheel"
    test_support = [n for n in names if n.startswith("kvpersist/testing/")]
    assert test_support == [], f"the wheel ships test support: {test_support}"
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", str(wheel)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def run(venv: Path, cwd: Path, *argv: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full.update(env or {})
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=180)


def test_the_wheel_runs_without_the_checkout(wheel_venv: Path, tmp_path: Path) -> None:
    probe = run(wheel_venv, tmp_path, "python", "-c",
                "import json, sys, kvpersist, kvpersist.l2.inventory as inv, kvpersist.connector;"
                "import kvpersist.l2.read_loop as rc;"
                "print(json.dumps([kvpersist.__file__, sys.path, inv._walk is not None,"
                " rc.has_c_loop()]))")
    assert probe.returncode == 0, probe.stderr
    where, path, has_c_walker, has_c_loop = json.loads(probe.stdout)
    assert where.startswith(str(wheel_venv)), where
    assert not any(p.startswith(str(REPO)) for p in path if "site-packages" not in p), path
    assert has_c_walker, "the wheel lacks the C walker"
    assert has_c_loop, "the wheel lacks the C read loop"
    help_text = run(wheel_venv, tmp_path, "kvp-admin", "--help")
    assert help_text.returncode == 0 and "cleanup" in help_text.stdout
    for command in ("kvp-server", "kvp-vllm"):
        assert run(wheel_venv, tmp_path, command, "--help").returncode == 0, command


def test_admin_and_server_from_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store = KvFileStore(root, 1 << 30)
    store.open(background_scan=False)
    ns = "kvp-" + "e" * 32
    for i in range(3):
        assert store.put(key_of(i, ns), bytes(4096)) == "stored"
    store.close()
    env = {"KVP_CACHE_ROOT": str(root), "KVP_ZMQ_PORT": str(free_port()),
           "KVP_HTTP_PORT": str(free_port()), "KVP_L1_SIZE_GB": "1", "KVP_CACHE_BUDGET_GB": "1"}
    report = run(wheel_venv, tmp_path, "kvp-admin", "report", "--json", "--active", ns, env=env)
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["namespaces"]
    assert [(r["namespace"], r["files"]) for r in rows] == [(ns, 3)]
    preflight = run(wheel_venv, tmp_path, "kvp-admin", "preflight", "--test", "--json", env=env)
    assert json.loads(preflight.stdout)["ok"], preflight.stdout
    try:
        started = run(wheel_venv, tmp_path, "kvp-server", "start", "--json", env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        status = run(wheel_venv, tmp_path, "kvp-server", "status", "--json", env=env)
        body = json.loads(status.stdout)
        assert body["healthy"], body
        adapters = body["server_status"]["storage_manager"]["l2_adapters"]
        assert adapters[0]["type"] == "KvPersistL2Adapter"
        assert adapters[0]["kvpersist_module"].startswith(str(wheel_venv)), adapters[0]
        assert adapters[0]["files"] == 3
    finally:
        stopped = run(wheel_venv, tmp_path, "kvp-server", "stop", "--json", env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
