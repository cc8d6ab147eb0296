"""How long a vLLM worker waits for the KV it is restoring: as long as the server is alive, up to a
ceiling, not a fixed ``mq_timeout``.

On CPU, LMCache moves restored KV from its L1 into vLLM's worker with the engine_driven pickle
transport: the server pickles every chunk of the request into one reply and the worker waits for
it with ``future.result(timeout=mq_timeout)``.  That reply grows with the conversation (2 GiB of
KV took longer than the 15 s ``KVP_MQ_TIMEOUT_S`` here), so a long restore that was found and
loaded was thrown away at the last step and recomputed.

Invariants
----------
* A reply is waited for ``base_s`` (LMCache's ``mq_timeout``) in any case, as LMCache does.
* Past ``base_s`` the wait goes on while the connector's heartbeat says the server is alive; it
  ends once the heartbeat has said *unhealthy* for ``dead_after_s`` without a break (a server
  busy pickling gigabytes may miss one beat: that is not a death), or at ``max_s`` in all
  (``KVP_LOOKUP_MAX_S``).  A reply that does not come is a failed load: vLLM recomputes
  (``kv_load_failure_policy=recompute``), never a wrong token.
* Only the pickle transport's ``prepare_retrieve`` is replaced; its reply handling is LMCache
  0.5.6's own, line for line (``tests/serving/test_transfer_wait.py`` checks the replaced method is
  still the one it was written against).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.kvpersist.transfer_wait")  # inherits vLLM's log handler
Clock = Callable[[], float]


class ReplyWait:
    """The wait policy of one worker (see module invariants)."""

    def __init__(self, alive: Callable[[], bool], *, base_s: float, max_s: float,
                 dead_after_s: float, poll_s: float = 0.25,
                 clock: Clock = time.monotonic) -> None:
        self.alive = alive
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self.dead_after_s = dead_after_s
        self.poll_s = poll_s
        self._clock = clock
        self.extended = 0  # replies that came after base_s (would have been lost before)
        self.abandoned = 0

    def result(self, future: Any) -> Any:
        """``future``'s result, or TimeoutError when the policy gives up on it."""
        began = self._clock()
        try:
            return future.result(timeout=self.base_s)
        except TimeoutError:
            pass
        unhealthy_since: float | None = None
        while True:
            now = self._clock()
            if now - began >= self.max_s:
                break
            if self.alive():
                unhealthy_since = None
            else:
                if unhealthy_since is None:
                    unhealthy_since = now
                if now - unhealthy_since >= self.dead_after_s:
                    break
            try:
                value = future.result(timeout=min(self.poll_s, self.max_s - (now - began)))
            except TimeoutError:
                continue
            self.extended += 1
            logger.info("kvpersist: a restore's KV arrived after %.1fs (beyond the %.0fs "
                        "KVP_MQ_TIMEOUT_S; waited because the server was alive)",
                        self._clock() - began, self.base_s)
            return value
        self.abandoned += 1
        raise TimeoutError


_installed: ReplyWait | None = None
_original: Any = None
_install_lock = threading.Lock()


def install(wait: ReplyWait) -> bool:
    """Make LMCache's pickle transport wait for retrieve replies by ``wait`` in this process.
    Returns False (and changes nothing) when LMCache's method is not the expected one."""
    global _installed, _original
    from lmcache.v1.multiprocess.transfer_context import pickle as transport

    with _install_lock:
        cls = transport.EngineDrivenContextPickle
        if _installed is None and getattr(cls.prepare_retrieve, "__qualname__", "") != \
                "EngineDrivenContextPickle.prepare_retrieve":
            logger.warning("kvpersist: LMCache's pickle transport is not the one kvpersist knows; "
                           "long restores are bounded by KVP_MQ_TIMEOUT_S")
            return False
        if _installed is None:
            _original = cls.prepare_retrieve
        _installed = wait

        def prepare_retrieve(self: Any, key: Any, instance_id: int) -> Any:
            future = self.req_client.prepare_retrieve(key, instance_id)
            policy = _installed
            try:
                response = (policy.result(future) if policy is not None
                            else future.result(timeout=self.mq_timeout))
            except TimeoutError:
                return None
            if not response.success or not response.data:
                return None
            return pickle.loads(response.data)

        prepare_retrieve.__qualname__ = "kvpersist.prepare_retrieve"
        cls.prepare_retrieve = prepare_retrieve
    return True


def uninstall() -> None:
    """Give LMCache its own method back (tests that install a policy in their own process)."""
    global _installed, _original
    from lmcache.v1.multiprocess.transfer_context import pickle as transport

    with _install_lock:
        if _original is not None:
            transport.EngineDrivenContextPickle.prepare_retrieve = _original
        _installed = _original = None
