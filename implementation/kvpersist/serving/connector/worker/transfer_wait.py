"""How long a vLLM worker waits for the LMCache server's answers: a restore's KV as long as the
server is alive (up to a ceiling), a store's receipt only while the server is healthy, and
nothing once nobody listens at the server's socket.

On CPU, LMCache moves KV between vLLM's worker and its L1 with the engine_driven pickle transport,
whose every call waits for the server with ``future.result(timeout=mq_timeout)``:

* a restore's reply grows with the conversation (2 GiB of KV took longer than the 15 s
  ``KVP_MQ_TIMEOUT_S`` here), so a long restore that was found and loaded was thrown away at its
  last step and recomputed;
* a store in flight when the server dies waited ``mq_timeout`` twice (prepare, then commit): the
  request that carried it took 30 s, although the answer can never come.

Invariants
----------
* A restore's reply (``prepare_retrieve``) is waited for while the server is alive, up to
  ``max_s`` (``KVP_LOOKUP_MAX_S``).  It is given up when nobody listens at the server's socket
  (``gone``: a killed server refuses connections), or once the heartbeat has said *unhealthy*
  for ``dead_after_s`` without a break (a stopped or wedged server; a server busy pickling
  gigabytes may miss one beat: that is not a death).  A reply that does not come is a failed
  load: vLLM recomputes (``kv_load_failure_policy=recompute``), never a wrong token.
* A receipt (``prepare_store``, ``commit_store``, ``commit_retrieve``) is waited for at most
  ``base_s`` (LMCache's ``mq_timeout``), as LMCache does, and given up as soon as the server is
  gone or the heartbeat says unhealthy: a lost store is a later miss, never worth a request's
  latency (LMCache's worker drops stores itself while unhealthy).
* The policy reaches LMCache through :mod:`kvpersist.serving.lmcache_compat.pickle_transport`,
  whose four methods are LMCache 0.5.6's own apart from the wait, statement for statement; where
  LMCache's differ (feature ``pickle_waits``), nothing is replaced and LMCache's fixed timeouts
  apply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.kvpersist.transfer_wait")  # inherits vLLM's log handler
Clock = Callable[[], float]


def never_gone() -> bool:
    return False


class ServerWait:
    """The wait policy of one worker (see module invariants)."""

    def __init__(self, alive: Callable[[], bool], *, base_s: float, max_s: float,
                 dead_after_s: float, gone: Callable[[], bool] = never_gone,
                 poll_s: float = 0.25, clock: Clock = time.monotonic) -> None:
        self.alive = alive
        self.gone = gone
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self.dead_after_s = dead_after_s
        self.poll_s = poll_s
        self._clock = clock
        self.extended = 0  # restore replies that came after base_s (lost before)
        self.abandoned = 0  # restore replies given up
        self.receipts_abandoned = 0  # store/commit receipts given up before base_s
        self.last_reason = ""  # why the policy last ended a wait

    def reply(self, future: Any) -> Any:
        """A restore's reply, or TimeoutError when the policy gives up on it."""
        began = self._clock()
        value = self._wait(future, self.max_s, patient=True)
        waited = self._clock() - began
        if waited > self.base_s:
            self.extended += 1
            logger.info("kvpersist: a restore's KV arrived after %.1fs (beyond the %.0fs "
                        "KVP_MQ_TIMEOUT_S; waited because the server was alive)",
                        waited, self.base_s)
        return value

    def receipt(self, future: Any) -> Any:
        """A store's or commit's answer, or TimeoutError (after ``base_s``, or at once when the
        server is gone or unhealthy)."""
        return self._wait(future, self.base_s, patient=False)

    def _wait(self, future: Any, limit_s: float, *, patient: bool) -> Any:
        began = self._clock()
        unhealthy_since: float | None = None
        step = min(self.poll_s, self.base_s)  # the first look: LMCache's base, if shorter
        while True:
            try:
                return future.result(timeout=max(0.0, min(step,
                                                          limit_s - (self._clock() - began))))
            except TimeoutError:
                step = self.poll_s
            now = self._clock()
            reason = ""
            if now - began >= limit_s:
                reason = f"no answer within {limit_s:.0f}s"
            elif self.gone():
                reason = "nobody listens at the server's socket"
            elif self.alive():
                unhealthy_since = None
            elif not patient:
                reason = "the heartbeat says the server is unhealthy"
            else:
                unhealthy_since = now if unhealthy_since is None else unhealthy_since
                if now - unhealthy_since >= self.dead_after_s:
                    reason = f"the heartbeat said unhealthy for {now - unhealthy_since:.0f}s"
            if reason:
                self._gave_up(reason, now - began, patient)
                raise TimeoutError(reason)

    def _gave_up(self, reason: str, waited: float, patient: bool) -> None:
        """Counts and logs what the policy ended (a receipt's timeout at the base is LMCache's
        own and is not counted)."""
        if patient:
            self.last_reason = reason
            self.abandoned += 1
            logger.warning("kvpersist: a restore's KV reply is given up after %.1fs (%s); the "
                           "request is recomputed", waited, reason)
        elif waited < self.base_s:
            self.last_reason = reason
            self.receipts_abandoned += 1
            if self.receipts_abandoned & (self.receipts_abandoned - 1) == 0:  # 1, 2, 4, ...
                logger.warning("kvpersist: a store's receipt is given up after %.1fs (%s; %d so "
                               "far)", waited, reason, self.receipts_abandoned)
