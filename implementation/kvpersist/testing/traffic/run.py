"""A traffic run through the real stack: the cache server and vLLM (through ``kvp-vllm``) as
processes, simulated users (:mod:`.users`), operator actions at planned times, a sampler of
what the processes hold, then the checks: a sample of answers asked again of an engine with
``KVP_CACHE_BYPASS=1``, the stopped tree checked by ``kvp-admin verify --check``, and nothing
left behind.

Invariants
----------
* Every process this module starts is stopped before :func:`run_traffic` returns, whether
  the run succeeded or raised.
* A planned vLLM restart drains the users first (:meth:`.users.UserPool.pause`); a cache
  server restart does not: vLLM must keep answering, uncached, while the server is away.
* Answers compare bit for bit when the engine ran one sequence at a time
  (``max_num_seqs == 1``): the cold and the cached computations then prefill the same
  256-token steps.  With more, CPU kernels are not batch-invariant: the last bits of a
  logprob depend on the batch and a greedy answer may part from the cold one at a near tie.
  There an answer is judged by its own tokens scored on the bypass engine
  (:mod:`.path_scores`): its served logprobs within :data:`BATCHED_LOGPROB_TOLERANCE` of the
  scores, with a control that shows a misplaced chunk moves them further.  Every sampled
  answer is scored so in both modes, and where the paths part is reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...config.server import ServerSettings, load_settings
from ...demo.stack import SERVED_MODEL_NAME, VllmProcess, metric_sum
from ...identity.fields import NAMESPACE_IN_TEXT
from ...identity.records import list_records
from ...serving.http import HttpError
from ...serving.lmcache_compat import status as server_status
from ...serving.pidfile import read_pid_file
from ...serving.server.lifecycle import start_server, stop_server
from ...serving.shm_sweep import SEGMENT_NAME, SHM_DIR, python_segments
from ..helpers import adapter_status, server_env, wait_for_l2_idle
from .path_scores import PathScoreError, score_and_judge
from .resources import shm_usage, tree_usage
from .shape import TrafficShape
from .summary import hit_rates, inter_token_latency, trend, ttft_by_length
from .users import RequestRecord, UserPool

#: Operator actions a plan may schedule.
ACTIONS = ("restart-server", "restart-vllm", "cleanup", "quota", "scrub")
#: Largest logprob difference accepted between batched and serial answers (see the module's
#: invariants); wrong KV moves a logprob of the tiny models by 1e-2 and more.
BATCHED_LOGPROB_TOLERANCE = 1e-3
GIB = 1 << 30
#: How long a stopped engine's KV mapping may stay in the server: its unregister, or else the
#: next pass of LMCache's reaper (every 30 s) finding its process gone.
RELEASE_WAIT_S = 45.0


@dataclass(frozen=True)
class StackSpec:
    """The stack a run drives: the model and its pins, where files go, and the tiers' sizes."""

    model_dir: Path
    pins: Path
    workdir: Path
    l1_gb: str
    budget_gb: str
    max_model_len: int
    max_num_seqs: int = 1
    lora_modules: dict[str, Path] = field(default_factory=dict)
    compile: bool = False


@dataclass(frozen=True)
class TrafficPlan:
    """How long users send, which operator actions happen when (seconds after the start), how
    often the processes are sampled, and how many answers are asked again cold."""

    shape: TrafficShape
    duration_s: float
    events: tuple[tuple[float, str], ...] = ()
    sample_interval_s: float = 5.0
    window_s: float = 60.0
    wrong_answer_sample: int = 16
    restore_tokens: int = 4096  # a "long restore" for the inter-token latency split

    def __post_init__(self) -> None:
        unknown = [a for _, a in self.events if a not in ACTIONS]
        if unknown:
            raise ValueError(f"unknown actions {unknown}; known: {', '.join(ACTIONS)}")


class TrafficStack:
    """The cache server and one vLLM, restartable, with ``kvp-admin`` run against them."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.env = server_env(spec.workdir / "cache", KVP_L1_SIZE_GB=spec.l1_gb,
                              KVP_CACHE_BUDGET_GB=spec.budget_gb)
        self.settings: ServerSettings = load_settings(self.env)
        self.vllm: VllmProcess | None = None
        self._engines = 0

    def engine(self, **extra_env: str) -> VllmProcess:
        self._engines += 1
        spec = self.spec
        args = ["--no-enable-prefix-caching", "--max-num-seqs", str(spec.max_num_seqs)]
        if spec.lora_modules:
            args += ["--enable-lora", "--max-lora-rank", "8",
                     "--max-loras", str(len(spec.lora_modules)), "--lora-modules",
                     *(f"{name}={path}" for name, path in spec.lora_modules.items())]
        return VllmProcess(spec.model_dir, spec.pins,
                           spec.workdir / f"vllm-{self._engines}.log",
                           {**self.env, **extra_env}, extra_args=args,
                           max_model_len=spec.max_model_len, compile=spec.compile)

    def start(self) -> None:
        start_server(self.settings)
        self.vllm = self.engine()
        self.vllm.start()

    def server_pid(self) -> int | None:
        record = read_pid_file(self.settings.pid_file)
        return record.pid if record is not None else None

    def restart_server(self) -> None:
        stop_server(self.settings)
        start_server(self.settings)

    def restart_vllm(self, users: UserPool) -> None:
        users.pause()
        try:
            assert self.vllm is not None
            self.vllm.stop()
            self.vllm = self.engine()
            self.vllm.start()
        finally:
            users.resume(self.vllm.base_url if self.vllm is not None else None)

    def admin(self, *argv: str, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
        """``kvp-admin ARGV --json``; its JSON answer (exit status outside ``ok`` raises)."""
        res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", *argv, "--json"],
                             env={**os.environ, **self.env}, capture_output=True, text=True,
                             timeout=900)
        if res.returncode not in ok:
            raise RuntimeError(f"kvp-admin {' '.join(argv)} exited {res.returncode}: "
                               f"{res.stderr.strip()[-800:]}")
        data: dict[str, Any] = json.loads(res.stdout) if res.stdout.strip() else {}
        data["exit"] = res.returncode
        return data

    def stop(self) -> None:
        if self.vllm is not None:
            self.vllm.kill()
            self.vllm = None
        stop_server(self.settings)


def operator_action(stack: TrafficStack, users: UserPool, action: str) -> dict[str, Any]:
    """Carry out ``action`` (one of :data:`ACTIONS`) on the running stack; what it reported."""
    budget = float(stack.spec.budget_gb)
    if action == "restart-server":
        stack.restart_server()
        return {}
    if action == "restart-vllm":
        stack.restart_vllm(users)
        return {}
    if action == "cleanup":  # down to half the budget, LRU tail first, through the server
        out = stack.admin("cleanup", "--apply", "--target-gb", f"{budget / 2:.4f}")
        return {k: out.get(k) for k in ("deleted_files", "deleted_bytes", "via_server")}
    if action == "quota":  # the largest namespace gets a quota of half its size, enforced
        report = stack.admin("report")
        largest = max(report["namespaces"], key=lambda row: row["bytes"])
        gb = largest["bytes"] / 2 / GIB
        stack.admin("quota", "set", largest["namespace"], f"{gb:.6f}")
        out = stack.admin("cleanup", "--apply")
        return {"namespace": largest["namespace"], "quota_gb": gb,
                **{k: out.get(k) for k in ("deleted_files", "deleted_bytes", "via_server")}}
    if action == "scrub":  # every file read and checked while traffic runs (a live server
        # quarantines what fails when it reads it; an offline scrub may quarantine itself)
        out = stack.admin("verify", ok=(0, 3))
        return {"checked": out.get("checked"), "failures": len(out.get("failures") or ()),
                "failure_reasons": sorted({f["reason"] for f in out.get("failures") or ()}),
                "quarantined": out.get("quarantined"), "vanished": out.get("vanished"),
                "seconds": out.get("seconds")}
    raise ValueError(f"unknown action {action!r}")


def sample(stack: TrafficStack, t: float) -> dict[str, Any]:
    """What the processes and the tier hold now (fields missing while a process is away)."""
    row: dict[str, Any] = {"t_s": round(t, 2)}
    for name, usage in (("server", tree_usage(stack.server_pid())),
                        ("vllm", tree_usage(stack.vllm.proc.pid if stack.vllm and
                                            stack.vllm.proc else None))):
        if not usage.processes:  # restarting: no figure rather than a zero
            continue
        for key, value in usage.as_dict().items():
            row[f"{name}_{key}"] = value
    shm = shm_usage()
    row["shm_segments"], row["shm_bytes"] = shm.segments, shm.allocated_bytes
    status = server_status.fetch(stack.settings.http_url, timeout=5)
    if status:
        adapters = server_status.kvpersist_adapters(status)
        if adapters:
            a = adapters[0]
            for key in ("used_bytes", "files", "evicted", "quarantine_files", "quarantine_bytes",
                        "reserved_bytes"):
                row[f"l2_{key}"] = a.get(key)
        l1 = server_status.storage_manager(status).get("l1_manager")
        if isinstance(l1, dict):
            for key, value in l1.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    row[f"l1_{key}"] = value
    return row


def _periodic(stop: threading.Event, interval: float, work: Callable[[], None]) -> None:
    while not stop.wait(interval):
        with contextlib.suppress(Exception):  # a sample lost while a process restarts
            work()


def compare_answers(first: RequestRecord, cold: Any, scored: dict[str, Any], *, exact: bool
                    ) -> dict[str, Any]:
    """``first`` (as served under traffic) against ``cold`` (asked of the bypass engine) and
    ``scored`` (:func:`.path_scores.judge` of ``first``'s own tokens, or ``{"error": ...}``).
    Exact: the answers equal bit for bit.  Batched: ``scored`` passed."""
    deltas = [abs(a - b) for a, b in zip(first.logprobs, cold.logprobs, strict=False)]
    same_tokens = list(first.tokens) == list(cold.tokens)
    worst = max(deltas, default=0.0)
    # where the greedy paths part, and how far the logprobs were apart up to there: a near tie
    # flipped by batch noise parts with tiny differences before it; wrong KV moves them early
    diverged_at = next((i for i, (a, b) in enumerate(zip(first.tokens, cold.tokens,
                                                           strict=False)) if a != b), None)
    before = deltas[:diverged_at + 1] if diverged_at is not None else deltas
    # at the parting, both paths share their context: the correct computation's logprobs of
    # the served token (scored) and of the cold one; a near tie is a small gap between them
    scores = scored.get("scores") or []
    tie_gap = (abs(scores[diverged_at] - cold.logprobs[diverged_at])
               if diverged_at is not None and diverged_at < min(len(scores), len(cold.logprobs))
               else None)
    bit_for_bit = same_tokens and list(first.logprobs) == list(cold.logprobs)
    ok = bit_for_bit if exact else bool(scored.get("ok"))
    return {"seq": first.seq, "conversation": first.conversation, "turn": first.turn,
            "prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
            "ok": ok, "same_tokens": same_tokens, "max_logprob_delta": worst,
            "diverged_at": diverged_at, "max_delta_up_to_divergence": max(before, default=0.0),
            "gap_at_divergence": tie_gap, "scored": scored,
            "served": {"tokens": list(first.tokens), "logprobs": list(first.logprobs)},
            "cold": {"tokens": list(cold.tokens), "logprobs": list(cold.logprobs)}}


def pick_sample(records: list[RequestRecord], count: int) -> list[RequestRecord]:
    """Up to ``count`` answered requests spread over the run, hits first (the answers a wrong
    cache would spoil), then misses."""
    done = sorted((r for r in records if r.error is None), key=lambda r: r.started_s)
    hits = [r for r in done if r.cached_tokens > 0]
    misses = [r for r in done if r.cached_tokens == 0]

    def spread_over(items: list[RequestRecord], k: int) -> list[RequestRecord]:
        if k <= 0 or not items:
            return []
        step = max(1, len(items) // k)
        return items[::step][:k]

    chosen = spread_over(hits, count - min(len(misses), count // 4))
    return chosen + spread_over(misses, count - len(chosen))


def run_traffic(spec: StackSpec, plan: TrafficPlan,
                progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run ``plan`` on a new stack of ``spec``; the results (see the module's invariants)."""
    spec.workdir.mkdir(parents=True, exist_ok=True)
    segments_before = python_segments()
    stack = TrafficStack(spec)
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    results: dict[str, Any] = {"shape": asdict(plan.shape), "duration_s": plan.duration_s,
                               "stack": {"l1_gb": spec.l1_gb, "budget_gb": spec.budget_gb,
                                         "max_num_seqs": spec.max_num_seqs,
                                         "max_model_len": spec.max_model_len,
                                         "lora": sorted(spec.lora_modules)}}
    stop_sampling = threading.Event()
    users: UserPool | None = None
    try:
        stack.start()
        assert stack.vllm is not None
        users = UserPool(plan.shape, stack.vllm.base_url, SERVED_MODEL_NAME)
        users.start()
        pool = users
        sampler = threading.Thread(
            target=_periodic, name="sampler", daemon=True,
            args=(stop_sampling, plan.sample_interval_s,
                  lambda: samples.append(sample(stack, pool.elapsed()))))
        sampler.start()
        for at, action in sorted(plan.events):
            time.sleep(max(0.0, at - users.elapsed()))
            began = users.elapsed()
            progress(f"{began:7.1f}s {action}")
            entry: dict[str, Any] = {"t_s": round(began, 2), "action": action}
            try:
                entry["result"] = operator_action(stack, users, action)
            except Exception as exc:  # an operator action that failed is a finding
                entry["error"] = f"{type(exc).__name__}: {exc}"[:800]
            entry["seconds"] = round(users.elapsed() - began, 2)
            events.append(entry)
        time.sleep(max(0.0, plan.duration_s - users.elapsed()))
        progress(f"{users.elapsed():7.1f}s users stop")
        users.stop()
        stop_sampling.set()
        sampler.join(30)
        samples.append(sample(stack, users.elapsed()))
        try:
            idle = wait_for_l2_idle(stack.settings, timeout=300)
        except AssertionError as exc:  # still busy: the figures are taken as they stand
            results["l2_not_idle"] = str(exc)[:500]
            idle = adapter_status(stack.settings)
        records = list(users.records)
        try:
            results.update(_checks(stack, users, records, plan, idle, progress))
        except Exception as exc:  # the records and samples are kept for the report
            results["check_error"] = f"{type(exc).__name__}: {exc}"[:800]
    finally:
        stop_sampling.set()
        stack.stop()
    results.update(_after_stop(stack, segments_before))
    results["events"], results["samples"] = events, samples
    results["records"] = [asdict(r) for r in users.records] if users is not None else []
    return results


def _checks(stack: TrafficStack, users: UserPool, records: list[RequestRecord],
            plan: TrafficPlan, idle: dict[str, Any], progress: Callable[[str], None]
            ) -> dict[str, Any]:
    """The summaries, then the wrong-answer sample on a bypass engine (the serving engine is
    stopped first: one engine at a time on the host)."""
    report = stack.admin("report")
    files = int(idle["files"])
    chunk_bytes = int(idle["used_bytes"]) // files if files else 1
    l1_bytes = int(float(stack.spec.l1_gb) * GIB)
    budgets = {"ideal_lru_at_budget": int(report["budget_bytes"]),
               "ideal_lru_at_reclaim_target": int(report["reclaim_target_bytes"]),
               "ideal_lru_at_l1_plus_budget": int(report["budget_bytes"]) + l1_bytes}
    failed = [r for r in records if r.error is not None]
    out: dict[str, Any] = {
        "requests": len(records), "failed": len(failed),
        "failures": [{"seq": r.seq, "t_s": r.started_s, "error": r.error} for r in failed[:20]],
        "chunk_bytes": chunk_bytes,
        "hit_rate": hit_rates(records, window_s=plan.window_s, chunk_bytes=chunk_bytes,
                              budgets=budgets),
        "ttft_by_length": ttft_by_length(records),
        "inter_token_latency": inter_token_latency(records, restore_tokens=plan.restore_tokens),
        "tier_at_end": {k: idle.get(k) for k in ("used_bytes", "files", "evicted",
                                                  "quarantine_files", "quarantine_bytes")},
    }
    assert stack.vllm is not None
    mapped = sorted(kv_segment_owners(stack.server_pid()))
    stack.vllm.stop()
    stack.vllm = None
    out["server_kv_mappings_after_engine_stop"] = {
        "mapped_before": mapped, "released_within_s": released_within(stack, RELEASE_WAIT_S)}
    chosen = pick_sample(records, plan.wrong_answer_sample)
    progress(f"asking {len(chosen)} answers again with KVP_CACHE_BYPASS=1")
    cold_engine = stack.engine(KVP_CACHE_BYPASS="1")
    stack.vllm = cold_engine
    cold_engine.start()
    from ...serving.launcher.vllm_client import stream_chat

    stores_before = int(adapter_status(stack.settings)["stores"])
    exact = stack.spec.max_num_seqs == 1
    compared = []
    for first in chosen:
        conv = users.conversations[first.conversation]
        messages = conv.messages(first.turn, plan.shape.turn_tokens)
        model = conv.model or SERVED_MODEL_NAME
        cold = stream_chat(cold_engine.base_url, messages, max_tokens=plan.shape.max_tokens_out,
                           timeout=900, model=model, cache_salt=conv.salt, token_ids=True)
        scored = score_served(cold_engine.base_url, messages, first, model)
        compared.append(compare_answers(first, cold, scored, exact=exact))
    time.sleep(3.0)  # on purpose: a store that must not come has nothing to wait on
    out["bypass_engine"] = bypass_evidence(stack, cold_engine, stores_before)
    unscored = [c for c in compared if "error" in c["scored"]]
    out["wrong_answer_sample"] = {
        "exact": exact, "asked": len(compared),
        # an answer whose check could not run is not counted wrong, but never passes
        "wrong": sum(not c["ok"] for c in compared if exact or "error" not in c["scored"]),
        "unscored": len(unscored),
        "parted": sum(not c["same_tokens"] for c in compared), "answers": compared}
    return out


def score_served(base_url: str, messages: list[dict[str, str]], first: RequestRecord,
                 model: str) -> dict[str, Any]:
    """:func:`.path_scores.score_and_judge` of the answer served as ``first``, or the reason
    it could not be scored."""
    try:
        return score_and_judge(base_url, messages, first.tokens, first.logprobs,
                               prompt_tokens=first.prompt_tokens, model=model,
                               tolerance=BATCHED_LOGPROB_TOLERANCE)
    except (PathScoreError, HttpError, OSError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def bypass_evidence(stack: TrafficStack, engine: VllmProcess, stores_before: int
                    ) -> dict[str, Any]:
    """What shows that an engine with ``KVP_CACHE_BYPASS=1`` kept the connector and resolved the
    identity but neither looked up nor stored: the server's stores since ``stores_before``, the
    engine's external hits, its log lines and the namespaces recorded in the tree."""
    log = engine.log_path.read_text(errors="replace")
    logged = NAMESPACE_IN_TEXT.search(log[log.find("KVP_CACHE_BYPASS is on"):]) if \
        "KVP_CACHE_BYPASS is on" in log else None
    return {"stores": int(adapter_status(stack.settings)["stores"]) - stores_before,
            "external_hits": metric_sum(engine.metrics(), "vllm:external_prefix_cache_hits_total"),
            "says_bypass": "KVP_CACHE_BYPASS is on: namespace kvp-" in log,
            "connector_loaded": "KvPersistConnector" in log,
            "namespace_logged": logged.group(0) if logged else None,
            "namespaces_recorded": sorted(list_records(stack.settings.cache_root))}


def released_within(stack: TrafficStack, timeout_s: float) -> float | None:
    """Seconds until the server maps no engine's KV segment (None: still mapped at
    ``timeout_s``); called with no engine registered."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if not kv_segment_owners(stack.server_pid()):
            return round(time.monotonic() - began, 2)
        time.sleep(0.5)
    return None


def kv_segment_owners(pid: int | None) -> set[int]:
    """Pids named by the engine KV segments (``lmcache_kv_<pid>_<n>``) process ``pid`` maps."""
    owners: set[int] = set()
    if pid is None:
        return owners
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address perms offset device inode [path]
            path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
            match = SEGMENT_NAME.match(path.removeprefix(f"{SHM_DIR}/"))
            if match:
                owners.add(int(match.group("pid")))
    return owners


def _after_stop(stack: TrafficStack, segments_before: set[str]) -> dict[str, Any]:
    """With everything stopped: the tree checked offline, and what was left behind."""
    check = stack.admin("verify", "--check", ok=(0, 3))
    left = sorted(python_segments() - segments_before)
    return {"verify_check": check, "left_behind": {
        "python_segments": left,
        "processes": processes_with_env("KVP_CACHE_ROOT", str(stack.settings.cache_root))}}


def processes_with_env(name: str, value: str) -> list[str]:
    """``pid command`` of every process whose environment sets ``name=value``: every process
    a run started (the server, vLLM and their children inherit the settings)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{entry.name} {command.decode(errors='replace')[:200]}")
        except OSError:
            continue
    return found


def trends(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trend of every leak-prone figure the sampler records."""
    keys = ("server_pss_bytes", "server_threads", "server_open_fds", "vllm_pss_bytes",
            "vllm_threads", "vllm_open_fds", "shm_segments", "l2_quarantine_bytes")
    return [trend(samples, k) for k in keys]
