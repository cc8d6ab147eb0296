"""A client of vLLM's OpenAI server and a handle on its process, for everything that drives a real
engine: the demo, the end-to-end tests, the benchmarks and ``kvp-admin recovery-test``.

Invariants
----------
* Every HTTP request has a timeout; nothing here can hang forever.
* vLLM runs in its own process group; ``stop``/``kill`` reach the API server, the engine core
  and its workers together, and leave no process behind.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import http
from ..shm_sweep import python_segments, sweep_python_segments, sweep_stale_segments

#: The ``kvp-vllm`` command, run by this interpreter.
KVP_VLLM = (sys.executable, "-m", "kvpersist.serving.launcher.kvp_vllm")


#: Where :func:`free_port` looks: below the kernel's ephemeral range, from this port up.
PORTS_FROM = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections' source and for binds to port 0."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback TCP port that is free now, for a server the caller starts next.

    Chosen below the ephemeral range, never by binding port 0: a port from that range can be
    taken, between this call and the server's bind, by the source port of any outgoing
    connection on the machine (seen: vLLM's start failed with EADDRINUSE while tests ran
    beside it).  Below it only a server binding that very port can collide; each pick is
    checked by binding it."""
    low, _high = ephemeral_ports()
    if low - PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(PORTS_FROM, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:  # a machine whose ephemeral range starts low
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


@dataclass(frozen=True)
class ChatResult:
    text: str
    tokens: list[str]
    logprobs: list[float]
    prompt_tokens: int
    seconds: float
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


def served_model(base_url: str, *, timeout: float = 10.0) -> str:
    """The first model id vLLM serves (``/v1/models``)."""
    resp = http.get(base_url + "/v1/models", timeout=timeout)
    if not resp.ok:
        raise http.HttpError(f"GET {base_url}/v1/models answered {resp.status}")
    return str(resp.json()["data"][0]["id"])


def chat_body(base_url: str, messages: list[dict[str, str]], *, max_tokens: int,
              model: str | None, cache_salt: str | None = None) -> dict[str, Any]:
    """A chat request at temperature 0 with logprobs (``model``: default the served one;
    ``cache_salt``: vLLM's per-request salt, which enters every cache key, so the request
    shares no cached chunk with unsalted ones)."""
    body = {"model": model or served_model(base_url), "messages": messages,
            "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True, "top_logprobs": 1,
            "seed": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def chat(base_url: str, messages: list[dict[str, str]], *, max_tokens: int = 16,
         timeout: float = 120.0, model: str | None = None,
         cache_salt: str | None = None) -> ChatResult:
    """One chat completion at temperature 0 with logprobs (``model`` and ``cache_salt`` as
    :func:`chat_body`)."""
    body = chat_body(base_url, messages, max_tokens=max_tokens, model=model,
                     cache_salt=cache_salt)
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
        cached_tokens=_cached_tokens(reply["usage"]),
    )


def _cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (0 when vLLM leaves it out)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def complete(base_url: str, prompt: str, *, max_tokens: int = 16, timeout: float = 120.0,
             model: str | None = None) -> ChatResult:
    """One text completion (``/v1/completions``) at temperature 0 with logprobs, for models
    whose chat format the server renders with tokens of its own (gpt-oss's harmony)."""
    body = {"model": model or served_model(base_url), "prompt": prompt,
            "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "seed": 0}
    began = time.monotonic()
    reply = http_json(base_url + "/v1/completions", body, timeout=timeout)
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    return ChatResult(
        text=choice["text"],
        tokens=list(logprobs["tokens"]),
        logprobs=[float(v) for v in logprobs["token_logprobs"]],
        prompt_tokens=int(reply["usage"]["prompt_tokens"]),
        seconds=time.monotonic() - began,
        cached_tokens=_cached_tokens(reply["usage"]),
    )


@dataclass
class VllmServer:
    """vLLM's OpenAI server run as ``command`` with ``env`` (its log at ``log_path``), listening on
    127.0.0.1:``port``.  Subclasses build the command; this class owns the process."""

    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: Python shared-memory names present before this run started (the run's are the others).
    _segments_before: frozenset[str] = frozenset()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait for ``/health``; returns seconds to ready."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._segments_before = frozenset(python_segments())
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
        """SIGTERM the whole process group; once its main process exited, give the rest (the
        resource tracker that unlinks its segments) a moment before SIGKILL; then remove the
        shared memory the run left (:meth:`_remove_orphaned_segments`)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        self._wait_group_gone(self.proc.pid, 10.0, kill_after=False)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._wait_group_gone(self.proc.pid, 15.0)
        self.proc = None
        self._remove_orphaned_segments()

    def kill(self) -> None:
        """SIGKILL the whole process group, then remove the shared memory the run left."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._wait_group_gone(self.proc.pid, 15.0)
        self.proc = None
        self._remove_orphaned_segments()

    def _remove_orphaned_segments(self) -> None:
        """Python's shared-memory segments that appeared while this run lived and that no
        process uses now: vLLM's message queues, whose unlink a killed group never reached."""
        made = python_segments() - set(self._segments_before)
        if made:
            sweep_python_segments(only=made)
        sweep_stale_segments()  # its workers' KV segments, unless a server still maps them

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float, *, kill_after: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        if kill_after:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


@dataclass(frozen=True)
class StreamedChat:
    """A streamed chat completion: the answer, the time to its first token, and when each token
    arrived (seconds after the request was sent, in stream order)."""

    text: str
    tokens: list[str]
    ttft_s: float
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)


def stream_chat(base_url: str, messages: list[dict[str, str]], *, max_tokens: int = 16,
                timeout: float = 600.0, model: str | None = None,
                cache_salt: str | None = None, token_ids: bool = False) -> StreamedChat:
    """One streamed chat completion at temperature 0; the time to first token is measured on
    the first content chunk.  ``timeout`` bounds every socket operation; ``cache_salt`` as
    :func:`chat_body`; ``token_ids``: the answer's tokens come as ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``), so they can be sent back as a prompt exactly."""
    import http.client as http_client
    import json
    import urllib.parse

    body = {**chat_body(base_url, messages, max_tokens=max_tokens, model=model,
                        cache_salt=cache_salt),
            "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_tokens_as_token_ids"] = True
    parts = urllib.parse.urlsplit(base_url)
    conn = http_client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    began = time.monotonic()
    ttft: float | None = None
    tokens: list[str] = []
    logprobs: list[float] = []
    token_times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise http.HttpError(f"POST {base_url}/v1/chat/completions answered {resp.status}: "
                                 f"{resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                content = (choice.get("logprobs") or {}).get("content") or []
                now = time.monotonic() - began
                if content and ttft is None:
                    ttft = now
                tokens.extend(str(c["token"]) for c in content)
                logprobs.extend(float(c["logprob"]) for c in content)
                token_times.extend(now for _ in content)
                text.append((choice.get("delta") or {}).get("content") or "")
    except OSError as exc:
        raise http.HttpError(f"no answer from {base_url}: {exc}") from None
    finally:
        conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return StreamedChat("".join(text), tokens, ttft if ttft is not None else float("nan"),
                        time.monotonic() - began, int(usage.get("prompt_tokens") or 0),
                        int(details.get("cached_tokens") or 0), logprobs, token_times)
