"""Late attach with real processes: vLLM started before the cache server serves uncached, turns
caching on by itself once the server answers (no vLLM restart), and what it stored then comes
back from L2 after a restart of both."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvpersist.config.server import ServerSettings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import TINY_PINS, l2_files, wait_for_l2_files

pytestmark = pytest.mark.e2e
ATTACHED = "late attach: the LMCache server lists namespace"


def wait_for_log(path: Path, text: str, timeout: float) -> float:
    began = time.monotonic()
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() - began < timeout, f"{text!r} not in {path} within {timeout}s"
        time.sleep(0.5)
    return time.monotonic() - began


def test_vllm_started_first_attaches_when_the_server_comes(
    tiny_model: Path, tmp_path: Path, server_env: dict[str, str], settings: ServerSettings
) -> None:
    root = settings.cache_root
    log = tmp_path / "vllm.log"
    vllm = VllmProcess(tiny_model, TINY_PINS, log, server_env)
    early, later = long_conversation(800, "topic early"), long_conversation(800, "topic later")
    try:
        vllm.start()  # no server yet
        assert "does not answer at start: serving uncached, attaching" in log.read_text()
        before = chat(vllm.base_url, early)
        assert before.cached_tokens == 0 and not root.exists()  # nothing could be stored

        start_server(settings)
        waited = wait_for_log(log, ATTACHED, timeout=90)
        print(f"\nattached {waited:.1f}s after the server answered")
        first = chat(vllm.base_url, later)
        stored = wait_for_l2_files(root, min_count=first.prompt_tokens // 256)
        assert stored, "nothing stored after the late attach"
        vllm.stop()
        stop_server(settings)

        # restart both: the chat stored after the attach comes back from L2
        start_server(settings)
        vllm.start()
        second = chat(vllm.base_url, later)
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits >= 256 * len(stored) - 256 and second.cached_tokens == hits, (hits, stored)
        assert second.tokens == first.tokens and second.logprobs == first.logprobs
    finally:
        vllm.kill()



WORKER_ON = "(role WORKER)"
PENDING = "did not answer this worker's registration in time: registering again"
REREGISTERED = "Finished re-registering KV caches after server recovery"  # LMCache's worker
UNANSWERED = ("did not answer this worker's registration",  # pending, to register again
              "did not register this worker's KV caches")  # closed (kvpersist before that)


def start_with_server_held(vllm: VllmProcess, log: Path, group: int) -> bool:
    """Start ``vllm`` and stop the server's process group (SIGSTOP) as soon as the worker's gate
    opened, before the worker registers its KV caches; True when the registration went
    unanswered (else it got through first and the caller tries again).  The whole group: the
    server leads its own session, and the kernel continues a stopped, orphaned group when one
    of its members exits (a server child did, 20 s in)."""
    failure: list[BaseException] = []

    def start() -> None:
        try:
            vllm.start()
        except BaseException as exc:  # re-raised in the test's thread
            failure.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    held = False
    while starter.is_alive() and not held:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "caching ON" in text and WORKER_ON in text:
            os.killpg(group, signal.SIGSTOP)  # the caller lets it run again
            held = True
        time.sleep(0.02)
    starter.join(timeout=300)  # the worker waits mq_timeout (15 s), then vLLM starts
    if failure:
        raise failure[0]
    text = log.read_text(errors="replace")
    return any(sign in text for sign in UNANSWERED)


def test_a_server_busy_through_registration_delays_the_cache_not_vllm(
    tiny_model: Path, tmp_path: Path, server_env: dict[str, str], settings: ServerSettings
) -> None:
    """The server is held (SIGSTOP) while vLLM's worker registers: vLLM starts anyway and
    serves uncached, storing nothing; let run again, the server handles the late registration,
    the worker registers again, and the same vLLM attaches by itself: what it computes then is
    stored, and asked again comes from the cache with the same tokens and logprobs (a store
    through a transfer context LMCache never marked registered would kill vLLM's engine)."""
    from kvpersist.testing.processes import server_pid

    topic, again = long_conversation(800, "topic held"), long_conversation(800, "topic after")
    start_server(settings)
    group = os.getpgid(server_pid(settings))
    vllm = None
    try:
        for attempt in range(3):
            log = tmp_path / f"vllm-{attempt}.log"
            vllm = VllmProcess(tiny_model, TINY_PINS, log, server_env,
                               extra_args=["--no-enable-prefix-caching"])
            if start_with_server_held(vllm, log, group):
                break
            os.killpg(group, signal.SIGCONT)  # the registration got through first: again
            vllm.stop()
        else:
            pytest.fail("the registration got through before the server was held, 3 times")
        text = log.read_text(errors="replace")
        assert PENDING in text and "not registered yet" in text  # the scheduler waits
        uncached = chat(vllm.base_url, topic)
        assert uncached.cached_tokens == 0 and not l2_files(settings.cache_root)
        os.killpg(group, signal.SIGCONT)
        waited = wait_for_log(log, ATTACHED, timeout=120)
        wait_for_log(log, REREGISTERED, timeout=60)
        print(f"\nattached {waited:.1f}s after the server ran again")
        first = chat(vllm.base_url, again)
        stored = wait_for_l2_files(settings.cache_root, min_count=first.prompt_tokens // 256)
        assert len(stored) >= first.prompt_tokens // 256 >= 3
        second = chat(vllm.base_url, again)  # vLLM's own prefix cache is off: LMCache's hit
        hits = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
        assert hits >= 256 * 3 and second.cached_tokens == hits, (hits, second.cached_tokens)
        assert second.tokens == first.tokens and second.logprobs == first.logprobs
        assert vllm.healthy()
    finally:
        os.killpg(group, signal.SIGCONT)
        if vllm is not None:
            vllm.kill()
