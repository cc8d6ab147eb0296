"""The documented service layout with real accounts, configured only by the site file.

As ``configs/systemd`` installs it: the cache server runs as its own account (``kvp-server run``,
the unit's command, with the unit's environment: ``KVP_CONFIG`` and telemetry off) with the
access group as its group, the runtime directory made by the installer as systemd makes it (0750,
the service's account and group); vLLM runs through ``kvp-vllm`` as another account that is a
member of that group; neither gets a kvpersist setting but the name of the site file.  After
both restart, the chat comes back from L2, bit-identical; the operator's ``kvp-admin`` finds the
server from the same file; the vLLM account cannot read the cache root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpersist.admin.recovery import recovery_chat
from kvpersist.config.environment import TELEMETRY_OFF, process_env
from kvpersist.demo.stack import EAGER_ARGS
from kvpersist.serving import http
from kvpersist.serving.launcher.vllm_client import KVP_VLLM, VllmServer, stream_chat
from kvpersist.testing import accounts
from kvpersist.testing.helpers import TINY_PINS, l2_files, wait_for_l2_files, wait_until

# serial: a vLLM started twice beside the shared pass's other engines starved the TP/PP
# restore tests on a 2-core host (CI lost their hits to "server unhealthy" at a load of 18)
pytestmark = [pytest.mark.e2e, pytest.mark.serial,
              pytest.mark.skipif(accounts.unavailable() is not None,
                                 reason=str(accounts.unavailable()))]
S, V, G = accounts.SERVICE_UID, accounts.VLLM_UID, accounts.ACCESS_GID
BIN = Path(sys.executable).parent


@dataclass
class Layout:
    base: Path
    site: Path
    cache: Path
    run: Path
    model: Path
    scratch: Path

    def unit_env(self) -> dict[str, str]:
        """What kvp-server.service gives the server: the site file's name and telemetry off."""
        return {"KVP_CONFIG": str(self.site), "PATH": "/usr/bin:/bin", **TELEMETRY_OFF}


@pytest.fixture
def layout(tiny_model: Path) -> Iterator[Layout]:
    base = Path(tempfile.mkdtemp(prefix="kvp-svc-", dir="/tmp"))
    base.chmod(0o755)
    scratch = base / "root-only"
    scratch.mkdir(mode=0o700)
    model = base / "model"
    shutil.copytree(tiny_model, model)
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    cache = base / "cache"  # install -d -m 0700 -o kvpersist
    cache.mkdir(mode=0o700)
    os.chown(cache, S, S)
    run = base / "run"  # RuntimeDirectory=kvpersist, RuntimeDirectoryMode=0750, Group=vllm
    run.mkdir()
    os.chown(run, S, G)
    run.chmod(0o750)
    (base / "home-v").mkdir(mode=0o700)
    os.chown(base / "home-v", V, V)
    site = base / "kvpersist.env"
    site.write_text(f"KVP_CACHE_ROOT={cache}\nKVP_RUNTIME_DIR={run}\nKVP_ACCESS=unix\n"
                    f"KVP_ACCESS_GROUP={G}\nKVP_L1_SIZE_GB=0.25\nKVP_CACHE_BUDGET_GB=1\n"
                    f"KVP_IDENTITY_PINS={TINY_PINS.resolve()}\n")
    site.chmod(0o644)
    yield Layout(base, site, cache, run, model, scratch)
    shutil.rmtree(base, ignore_errors=True)


@dataclass
class ServiceServer:
    """``kvp-server run`` as the service account, in the foreground, as the unit runs it."""

    layout: Layout
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.layout.base / "server.journal"

    def start(self) -> None:
        cmd = accounts.as_account([str(BIN / "kvp-server"), "run"], uid=S, gid=G,
                                  scratch=self.layout.scratch)
        with self.log.open("ab") as out:
            # A system account's home is not writable under the unit (ProtectSystem=strict).
            self.proc = subprocess.Popen(cmd, env={**self.layout.unit_env(),
                                                   "HOME": "/nonexistent"},
                                         stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                         start_new_session=True)
        sock = self.layout.run / "http.sock"
        wait_until(lambda: self.proc is not None and (self.proc.poll() is not None or (
            sock.exists() and http.answers(
                "http+unix://" + str(sock).replace("/", "%2F") + "/healthcheck", timeout=1))),
            timeout=120, message="the service's server did not answer")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        assert "CLI-only mode" not in self.log.read_text()  # LMCache's kernels loaded

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # KillSignal=SIGTERM
            self.proc.wait(timeout=60)
        self.proc = None


@dataclass
class VllmAsAccount(VllmServer):
    """``kvp-vllm`` as vLLM's account (a member of the access group), told only the site file."""

    layout: Layout | None = None

    def command(self) -> list[str]:
        assert self.layout is not None
        recipe = [str(self.layout.model), "--dtype", "float32", "--max-model-len", "2048",
                  "--max-num-batched-tokens", "256", "--served-model-name", "tiny", *EAGER_ARGS]
        return accounts.as_account(
            [*KVP_VLLM, *recipe, "--host", "127.0.0.1", "--port", str(self.port)],
            uid=V, gid=V, groups=[G], scratch=self.layout.scratch)

    def environment(self) -> dict[str, str]:
        assert self.layout is not None
        return process_env({"KVP_CONFIG": str(self.layout.site), "PATH": "/usr/bin:/bin",
                            "HOME": str(self.layout.base / "home-v"),
                            "VLLM_CPU_KVCACHE_SPACE": "1"})


def test_the_service_layout_comes_back_from_l2_after_both_restart(layout: Layout) -> None:
    server = ServiceServer(layout)
    vllm = VllmAsAccount(layout.base / "vllm.log", layout=layout)
    messages = recovery_chat(uuid.uuid4().hex[:12], 300)
    try:
        server.start()
        vllm.start(timeout=300)
        cold = stream_chat(vllm.base_url, messages, timeout=120)
        assert cold.cached_tokens == 0 and cold.tokens
        stored = wait_for_l2_files(layout.cache, 1)
        assert all(os.stat(layout.cache / name).st_uid == S for name in stored)

        vllm.stop()
        server.stop()
        server.start()
        vllm.start(timeout=300)
        warm = stream_chat(vllm.base_url, messages, timeout=120)
        assert warm.cached_tokens > 0, vllm.log_tail(60)
        assert warm.tokens == cold.tokens
        assert set(l2_files(layout.cache)) == set(stored)  # restored, not stored again

        # The operator's kvp-admin, given only the site file, finds the server and its tree.
        operator = {"KVP_CONFIG": str(layout.site), "PATH": "/usr/bin:/bin", **TELEMETRY_OFF}
        status = subprocess.run([str(BIN / "kvp-admin"), "status", "--json"], env=operator,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["healthy"] is True
        # The vLLM account uses the sockets through the group, never the tree itself.
        peek = subprocess.run(accounts.as_account(["ls", str(layout.cache)], uid=V, gid=V,
                                                  groups=[G], scratch=layout.scratch),
                              capture_output=True, text=True, timeout=60)
        assert peek.returncode != 0 and "Permission denied" in peek.stderr
    finally:
        vllm.stop()
        server.stop()
