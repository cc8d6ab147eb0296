"""The recovery acceptance test: does a conversation come back from L2 after vLLM restarts (A), and
after both vLLM and the cache server restart (B)?

It drives the deployment's own launchers: the running server (``kvp-server``'s settings) and vLLM
started through ``kvp-vllm`` with the recipe's arguments, on a loopback port of its own.

Invariants
----------
* Every wait is bounded (server start, vLLM start, each request, the wait for stores); a stack
  that is not running, or a server without the kvpersist adapter, is a FAIL with the reason,
  found before anything is started.
* A hit counts as "from L2" only with evidence: the server's L2 hit counter moved after a marker
  taken before the request, L1 was cleared first (scenario A), and in scenario B the read
  sectors of a cache device grew after the page cache was dropped (or, with
  ``evict="cache-files"``, the cache files' own pages evicted: every other process keeps its
  cached pages).  With several L2 roots every root's device is counted and named, and a read
  from any of them is the evidence (a chat's chunks are spread over them).  Evidence that
  cannot be had (no block device behind any root, no right to drop the page cache, L1 not
  clearable) makes the check INCONCLUSIVE, never a PASS.
* The verdict is FAIL when any check failed, else INCONCLUSIVE when any check was, else PASS.
* The server is restarted the way the operator says (``KVP_SERVER_RESTART``, e.g.
  ``systemctl restart kvp-server``); without it the test stops and starts the server itself,
  which it refuses up front when the server runs under another account or a systemd unit (it
  would come back outside the unit, or not at all).  In scenario B the page cache is dropped
  once the restarted server answers, so nothing the start did is left in it.
* Results go where the operator says (``--out``, ``KVP_RESULTS_DIR``), never to a path relative
  to a checkout.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config.environment import process_env
from ..config.server import ServerSettings
from ..serving import http
from ..serving.launcher.vllm_client import (
    KVP_VLLM,
    StreamedChat,
    VllmServer,
    metric_sum,
    stream_chat,
)
from ..serving.lmcache_compat import status as server_status
from ..serving.pidfile import PidState, check_pid_file
from ..serving.server.lifecycle import ServerError, is_healthy, start_server, stop_server
from .page_cache import drop_page_cache, evict_files

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}


@dataclass(frozen=True)
class Check:
    scenario: str  # "pre", "A" or "B"
    name: str
    status: str  # PASS, FAIL or INCONCLUSIVE
    detail: str


@dataclass(frozen=True)
class Marker:
    """The server's counters at one moment (from its /metrics)."""

    stores: float
    stored_bytes: float
    used_bytes: float
    l2_hit_tokens: float

    @classmethod
    def read(cls, settings: ServerSettings, timeout: float = 10.0) -> Marker:
        text = http.get(settings.http_url + "/metrics", timeout=timeout).body.decode()
        return cls(metric_sum(text, "kvpersist_l2_stores_total"),
                   metric_sum(text, "kvpersist_l2_stored_bytes_total"),
                   metric_sum(text, "kvpersist_l2_used_bytes"),
                   metric_sum(text, "lmcache_mp_lookup_hit_l2_tokens_total"))


def block_device_of(path: Path, named: str | None) -> str | None:
    """The /proc/diskstats name of ``named`` (``KVP_CACHE_BLOCK_DEVICE``: ``nvme0n1`` or
    ``/dev/nvme0n1``), else of the device holding ``path``; None when there is none."""
    if named:
        return Path(named).name
    try:
        st = os.stat(path)
    except OSError:
        return None
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    link = Path(f"/sys/dev/block/{major}:{minor}")
    return link.resolve().name if link.exists() else None


def root_devices(roots: Sequence[Path], named: str | None) -> list[tuple[Path, str | None]]:
    """Each L2 root with its /proc/diskstats device name: ``named`` (``KVP_CACHE_BLOCK_DEVICE``)
    stands for the first root only; every other root's device is found from its path."""
    return [(root, block_device_of(root, named if i == 0 else None))
            for i, root in enumerate(roots)]


@dataclass(frozen=True)
class DeviceReads:
    """Sectors read from each root's device before a restore (None: no device or no count)."""

    before: list[tuple[Path, str | None, int | None]]

    @classmethod
    def take(cls, devices: Sequence[tuple[Path, str | None]],
             diskstats: Path = Path("/proc/diskstats")) -> DeviceReads:
        return cls([(root, dev, sectors_read(dev, diskstats) if dev else None)
                    for root, dev in devices])

    def unknown(self) -> list[Path]:
        """Roots whose device reads cannot be counted."""
        return [root for root, dev, sectors in self.before if dev is None or sectors is None]

    def verdict(self, diskstats: Path = Path("/proc/diskstats")) -> tuple[bool | None, str]:
        """(True: some root's device was read since :meth:`take`; False: none was; None: no
        root's reads can be counted) and a detail naming every device.  The chunks of a chat are
        spread over the roots, so a read from any of their devices is the evidence."""
        parts, grew, counted = [], False, False
        for root, dev, sectors in self.before:
            now = sectors_read(dev, diskstats) if dev else None
            if dev is None or sectors is None or now is None:
                parts.append(f"{root}: no block device (set KVP_CACHE_BLOCK_DEVICE for the "
                             "first root)" if dev is None else f"{dev}: not in diskstats")
                continue
            counted = True
            grew = grew or now > sectors
            parts.append(f"{dev}: {sectors} -> {now} sectors read")
        return (grew if counted else None), "; ".join(parts)


def sectors_read(device: str, diskstats: Path = Path("/proc/diskstats")) -> int | None:
    for line in diskstats.read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[2] == device:
            return int(fields[5])
    return None


def systemd_unit_of(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The systemd service unit whose cgroup holds ``pid`` (``kvp-server.service``), or None."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        for part in reversed(line.rsplit(":", 1)[-1].split("/")):
            if part.endswith(".service") and not part.startswith("user@"):
                return part
    return None


def server_owner(settings: ServerSettings) -> tuple[int, int] | None:
    """(pid, uid) of the running server from its pid file, or None."""
    status = check_pid_file(settings.pid_file)
    if status.state is not PidState.RUNNING or status.record is None:
        return None
    try:
        return status.record.pid, os.stat(f"/proc/{status.record.pid}").st_uid
    except OSError:
        return None


def recovery_chat(nonce: str, words: int) -> list[dict[str, str]]:
    """A conversation nobody has sent before (the nonce leads it), about ``words`` words long."""
    sentences: list[str] = []
    i = 0
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(f"Fact {i}: the persistent tier keeps chunk {i * 7 % 31} of this "
                         f"conversation on fast local storage.")
        i += 1
    return [{"role": "system", "content": f"Recovery test {nonce}. Answer briefly."},
            {"role": "user", "content": " ".join(sentences)},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Summarise the facts."}]


@dataclass
class LauncherVllm(VllmServer):
    """vLLM started through ``kvp-vllm`` with the recipe's arguments, on our own port."""

    recipe: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [*KVP_VLLM, *self.recipe, "--host", "127.0.0.1", "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        return process_env(self.env)


@dataclass
class RecoveryTest:
    settings: ServerSettings
    recipe: list[str]
    out: Path
    words: int = 600
    device: str | None = None
    #: how scenario B's restore is made cold (:data:`kvpersist.admin.page_cache.EVICT_CHOICES`)
    evict: str = "page-cache"
    vllm_timeout_s: float = 900.0
    request_timeout_s: float = 900.0
    store_wait_s: float = 120.0
    #: the operator's restart command (``KVP_SERVER_RESTART``); None: stop and start here
    restart: str | None = None
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    # -- bookkeeping
    def check(self, scenario: str, name: str, ok: bool | None, detail: str) -> bool:
        status = INCONCLUSIVE if ok is None else PASS if ok else FAIL
        self.checks.append(Check(scenario, name, status, detail))
        self.say(f"[{status}] {scenario}: {name}: {detail}")
        return bool(ok)

    @property
    def verdict(self) -> str:
        statuses = {c.status for c in self.checks}
        return FAIL if FAIL in statuses else INCONCLUSIVE if INCONCLUSIVE in statuses else PASS

    def write_results(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        failed = [c for c in self.checks if c.status != PASS]
        (self.out / "failures.txt").write_text(
            "".join(f"{c.status} {c.scenario}: {c.name}: {c.detail}\n" for c in failed))
        (self.out / "results.json").write_text(json.dumps({
            "verdict": self.verdict, "checks": [asdict(c) for c in self.checks],
            "figures": self.figures, "recipe": self.recipe,
            "cache_root": str(self.settings.cache_root),
            "l2_roots": [str(r) for r in self.settings.l2_roots]}, indent=2) + "\n")

    # -- the run
    def run(self) -> str:
        try:
            if self.preconditions():
                self.scenarios()
        finally:
            self.write_results()
        return self.verdict

    def preconditions(self) -> bool:
        if not is_healthy(self.settings, timeout=3.0):
            return self.check("pre", "server answers", False,
                              f"the LMCache server does not answer at {self.settings.http_url}; "
                              "start the deployment first (kvp-server start)")
        status = server_status.fetch(self.settings.http_url, timeout=10.0) or {}
        if not server_status.kvpersist_adapters(status):
            return self.check("pre", "kvpersist L2 adapter", False,
                              "the server runs without the kvpersist L2 adapter "
                              f"(KVP_L2_ADAPTER={self.settings.l2_adapter}); nothing to recover")
        refused = self._self_restart_refused()
        if refused is not None:
            return self.check("pre", "server restart", False, refused)
        if not self.env.get("KVP_IDENTITY_PINS"):
            return self.check("pre", "identity pins", False, "KVP_IDENTITY_PINS is not set: "
                              "point it at configs/<model>/identity.env")
        return self.check("pre", "stack", True, f"server at {self.settings.http_url} with the "
                          "kvpersist adapter; vLLM through kvp-vllm")

    def _self_restart_refused(self) -> str | None:
        """Why this test must not restart the server itself, or None."""
        if self.restart is not None:
            return None
        owner = server_owner(self.settings)
        if owner is None:
            return None
        pid, uid = owner
        unit = systemd_unit_of(pid)
        if unit is not None:
            return (f"the server (pid {pid}) runs under the systemd unit {unit}; set "
                    f"KVP_SERVER_RESTART='systemctl restart {unit}' so the test restarts it "
                    "through the unit")
        if uid != os.geteuid():
            return (f"the server (pid {pid}) runs as uid {uid}, this test as uid "
                    f"{os.geteuid()}: run the test as the server's account (with --evict "
                    "cache-files), or set KVP_SERVER_RESTART to the command that restarts it")
        return None

    def restart_server(self) -> None:
        """Restart the server as the operator said (or stop and start it here), then wait until
        it answers (at most ``KVP_START_TIMEOUT_S``)."""
        if self.restart is None:
            stop_server(self.settings)
            start_server(self.settings)
            return
        done = subprocess.run(shlex.split(self.restart), capture_output=True, text=True,
                              timeout=self.settings.stop_timeout_s
                              + self.settings.start_timeout_s, check=False)
        if done.returncode != 0:
            raise ServerError(f"KVP_SERVER_RESTART={self.restart!r} exited with "
                              f"{done.returncode}: {done.stderr.strip()[-500:]}")
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not is_healthy(self.settings, timeout=2.0):
            if time.monotonic() > deadline:
                raise ServerError(f"the server did not answer within "
                                  f"{self.settings.start_timeout_s:.0f}s after "
                                  f"{self.restart!r}")
            time.sleep(0.5)

    def _chat(self, vllm: LauncherVllm, messages: list[dict[str, str]]) -> StreamedChat:
        return stream_chat(vllm.base_url, messages, timeout=self.request_timeout_s)

    def _wait_stores(self, before: Marker) -> Marker:
        deadline = time.monotonic() + self.store_wait_s
        while True:
            now = Marker.read(self.settings)
            if (now.stores > before.stores and now.used_bytes > before.used_bytes) \
                    or time.monotonic() > deadline:
                return now
            time.sleep(1.0)

    def _settle(self) -> Marker:
        """The counters once the server has finished what the last request started."""
        time.sleep(3.0)
        return Marker.read(self.settings)

    def scenarios(self) -> None:
        messages = recovery_chat(uuid.uuid4().hex[:12], self.words)
        vllm = LauncherVllm(self.out / "vllm.log", recipe=self.recipe, env=self.env)
        try:
            self.say("cold: starting vLLM through kvp-vllm")
            vllm.start(timeout=self.vllm_timeout_s)
            marker = Marker.read(self.settings)
            cold = self._chat(vllm, messages)
            self.figures["cold"] = asdict(cold)
            if not self.check("pre", "cold request computed", cold.cached_tokens == 0
                              and bool(cold.tokens),
                              f"{cold.prompt_tokens} prompt tokens, TTFT {cold.ttft_s:.2f}s, "
                              f"cached {cold.cached_tokens}"):
                return
            stored = self._wait_stores(marker)
            self.check("pre", "stored before the restart",
                       stored.stores > marker.stores and stored.used_bytes > marker.used_bytes,
                       f"store counter {marker.stores:.0f} -> {stored.stores:.0f}, L2 bytes "
                       f"{marker.used_bytes:.0f} -> {stored.used_bytes:.0f}")

            self.say("scenario A: restarting vLLM (the server keeps running)")
            vllm.stop()
            vllm.start(timeout=self.vllm_timeout_s)
            cleared = http.request("POST", self.settings.http_url + "/cache/clear",
                                   payload={"tier": "l1", "force": True}, timeout=30.0)
            self.check("A", "L1 cleared", True if cleared.ok else None,
                       "the hit can only come from L2" if cleared.ok else
                       f"/cache/clear answered {cleared.status}: an L1 hit cannot be ruled out")
            self.restored("A", vllm, messages, cold, device_reads=None)

            cold_by = ("page cache dropped" if self.evict == "page-cache"
                       else "the cache files' pages evicted")
            self.say(f"scenario B: restarting vLLM and the server, {cold_by}")
            vllm.stop()
            self.restart_server()
            dropped: str | None = None
            try:
                if self.evict == "page-cache":
                    drop_page_cache()
                else:
                    for root in self.settings.l2_roots:
                        evict_files(root)
            except OSError as exc:
                dropped = (f"cannot drop the page cache ({exc.strerror}); run as root"
                           if self.evict == "page-cache" else
                           f"cannot evict the cache files' pages ({exc.strerror})")
            reads = DeviceReads.take(root_devices(self.settings.l2_roots, self.device))
            vllm.start(timeout=self.vllm_timeout_s)
            self.restored("B", vllm, messages, cold,
                          device_reads=reads if dropped is None else dropped)
        except (http.HttpError, RuntimeError, ServerError, OSError, ValueError) as exc:
            self.check("run", "the run completed", False, f"{type(exc).__name__}: {exc}")
        finally:
            vllm.stop()
            if not is_healthy(self.settings, timeout=3.0):  # leave the server as we found it
                try:
                    if self.restart is None:
                        start_server(self.settings)
                    else:
                        self.restart_server()
                except (ServerError, OSError, subprocess.TimeoutExpired) as exc:
                    self.check("run", "server restarted after the test", False, str(exc))

    def restored(self, scenario: str, vllm: LauncherVllm, messages: list[dict[str, str]],
                 cold: StreamedChat, *, device_reads: DeviceReads | str | None) -> None:
        before = Marker.read(self.settings)
        warm = self._chat(vllm, messages)
        after = self._settle()
        self.figures[scenario] = asdict(warm)
        self.check(scenario, "cached tokens reported", warm.cached_tokens > 0,
                   f"usage.prompt_tokens_details.cached_tokens = {warm.cached_tokens} of "
                   f"{warm.prompt_tokens}")
        self.check(scenario, "hit from L2", after.l2_hit_tokens > before.l2_hit_tokens,
                   f"L2 hit tokens {before.l2_hit_tokens:.0f} -> {after.l2_hit_tokens:.0f}")
        if device_reads is not None:
            if isinstance(device_reads, str):
                self.check(scenario, "read from the cache device", None, device_reads)
            else:
                self.check(scenario, "read from the cache device", *device_reads.verdict())
        self.check(scenario, "no new L2 data for the same chat",
                   after.used_bytes <= before.used_bytes,
                   f"L2 bytes {before.used_bytes:.0f} -> {after.used_bytes:.0f}")
        self.check(scenario, "TTFT dropped", warm.ttft_s < cold.ttft_s,
                   f"{warm.ttft_s:.3f}s vs cold {cold.ttft_s:.3f}s "
                   f"({cold.ttft_s / max(warm.ttft_s, 1e-9):.1f}x)")
        self.check(scenario, "identical answer", warm.tokens == cold.tokens,
                   "same tokens at temperature 0" if warm.tokens == cold.tokens else
                   f"{warm.text!r} != {cold.text!r}")


#: Where results go when neither ``--out`` nor ``KVP_RESULTS_DIR`` says.
DEFAULT_RESULTS_DIR = Path("/var/tmp/kvpersist-results")


def default_out(base: Path | None = None) -> Path:
    """A new folder under ``base`` (``KVP_RESULTS_DIR``, default :data:`DEFAULT_RESULTS_DIR`)."""
    return ((base or DEFAULT_RESULTS_DIR)
            / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-recovery")


def run_recovery_test(settings: ServerSettings, recipe: Sequence[str], out: Path,
                      **options: Any) -> tuple[str, RecoveryTest]:
    test = RecoveryTest(settings, list(recipe), out, **options)
    return test.run(), test
