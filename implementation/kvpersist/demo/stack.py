"""Drive the whole stack as real processes: vLLM through our launcher, chat requests, metrics.

Used by the CPU demo and the end-to-end tests, so both exercise exactly what an operator runs
(``kvp-vllm``, which ``scripts/run-vllm-with-persist.sh`` wraps).

Invariants
----------
* Every HTTP request has a timeout; nothing here can hang forever.
* vLLM runs in its own process group; ``stop``/``kill`` reach the API server, the engine core
  and its workers together, and leave no process behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.environment import process_env
from ..serving import http

LAUNCHER = (sys.executable, "-m", "kvpersist.serving.launcher")  # = the kvp-vllm command
SERVED_MODEL_NAME = "tiny"
PREFILL_STEP_TOKENS = 256  # LMCache's chunk size


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_json(url: str, body: dict[str, Any], *, timeout: float) -> Any:
    """POST ``body``; the JSON answer.  A non-2xx answer raises HttpError with its body."""
    resp = http.request("POST", url, payload=body, timeout=timeout)
    if not resp.ok:
        raise http.HttpError(f"POST {url} answered {resp.status}: {resp.body[:500]!r}")
    return resp.json()


def http_text(url: str, *, timeout: float) -> str:
    return http.get(url, timeout=timeout).body.decode()


_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")


def metric_sum(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of all samples of ``name`` (Prometheus text) whose labels include ``labels``."""
    total = 0.0
    for line in metrics_text.splitlines():
        match = _SAMPLE_RE.match(line.strip())
        if match is None or match.group("name") != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group("labels") or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group("value"))
    return total


def long_conversation(target_tokens: int = 900, topic: str = "the persistent KV cache"
                      ) -> list[dict[str, str]]:
    """A multi-turn chat of about ``target_tokens`` tokens for the byte-level tiny model.

    Different ``topic`` values differ from the first message on, so they share no cached chunk.
    """
    messages = [{"role": "system", "content": f"You are the kvpersist assistant for {topic}."}]
    turn = 0
    while sum(len(m["content"]) for m in messages) < target_tokens:
        messages.append({"role": "user", "content":
                         f"Turn {turn}: please remember fact number {turn * 7 % 13} about the "
                         f"{topic} and the NVMe tier it lives on."})
        messages.append({"role": "assistant", "content":
                         f"Noted fact {turn * 7 % 13}; the prefix of this chat is cached."})
        turn += 1
    messages.append({"role": "user", "content": "Summarise everything so far."})
    return messages


@dataclass(frozen=True)
class ChatResult:
    text: str
    tokens: list[str]
    logprobs: list[float]
    prompt_tokens: int
    seconds: float
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


def chat(base_url: str, messages: list[dict[str, str]], *, max_tokens: int = 16,
         timeout: float = 120.0) -> ChatResult:
    """One chat completion at temperature 0 with logprobs."""
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 1, "seed": 0}
    began = time.monotonic()
    reply = http_json(base_url + "/v1/chat/completions", body, timeout=timeout)
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    return ChatResult(
        text=choice["message"]["content"],
        tokens=[c["token"] for c in content],
        logprobs=[float(c["logprob"]) for c in content],
        prompt_tokens=int(reply["usage"]["prompt_tokens"]),
        seconds=time.monotonic() - began,
        cached_tokens=int((reply["usage"].get("prompt_tokens_details") or {})
                          .get("cached_tokens") or 0),
    )


@dataclass
class VllmProcess:
    """vLLM's OpenAI server for ``model_dir`` started through our launcher."""

    model_dir: Path
    pins: Path
    log_path: Path
    server_env: dict[str, str]
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    kv_persist: bool = True
    max_model_len: int = 2048
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [*LAUNCHER, str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", SERVED_MODEL_NAME,
                "--dtype", "float32", "--max-model-len", str(self.max_model_len),
                # Prefill in steps of one LMCache chunk: a cold request then computes the tail
                # after the last full chunk exactly as a warm request (prefix loaded from L2)
                # does, so the two give bit-identical logprobs, not merely close ones.
                "--max-num-batched-tokens", str(PREFILL_STEP_TOKENS), *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = process_env(None, **self.server_env)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["KV_PERSIST"] = "1" if self.kv_persist else "0"
        env["KVP_IDENTITY_PINS"] = str(self.pins)
        return env

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait for ``/health``; returns seconds to ready."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(self.command(), env=self.environment(),
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} during start; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return time.monotonic() - began
            time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"vLLM not ready within {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def healthy(self, timeout: float = 2.0) -> bool:
        return http.answers(self.base_url + "/health", timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def metrics(self, timeout: float = 10.0) -> str:
        return http_text(self.base_url + "/metrics", timeout=timeout)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left after ``timeout``."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._wait_group_gone(self.proc.pid, 15.0)
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._wait_group_gone(self.proc.pid, 15.0)
        self.proc = None

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
