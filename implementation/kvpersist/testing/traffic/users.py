"""Simulated users: one thread each, returning to their own conversations after think times
and streaming every answer, until told to stop.

Invariants
----------
* A user has at most one request in flight (a person waits for the answer), so the turns of a
  conversation are sent in order and each extends the one before (:mod:`.shape`).
* A turn advances only when its request succeeded; a failed request is recorded with its error
  and the same turn is asked again on the user's next visit.
* :meth:`UserPool.pause` returns only when no request is in flight, and no request starts
  until :meth:`UserPool.resume`: what a load balancer does while an engine is replaced, so a
  planned vLLM restart costs waiting, never a failed request.
* Every request ever sent is in :attr:`UserPool.records` once answered or failed, numbered
  (``seq``) in that order; ``started_s`` orders them as sent.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field

from ...serving.launcher.vllm_client import stream_chat
from .shape import Conversation, Population, TrafficShape, think_time


@dataclass(frozen=True)
class RequestRecord:
    """One request as sent and answered (``error`` set when it failed; the answer empty)."""

    seq: int
    user: int
    conversation: str
    turn: int
    started_s: float  # after the run began
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = float("nan")
    seconds: float = float("nan")
    tokens: tuple[str, ...] = ()  # as ``token_id:N`` (vLLM's return_tokens_as_token_ids)
    logprobs: tuple[float, ...] = ()
    token_times: tuple[float, ...] = ()  # after started_s
    error: str | None = None


@dataclass
class UserPool:
    """``shape.users`` threads sending to ``base_url`` (changeable while they run)."""

    shape: TrafficShape
    base_url: str
    served_model: str
    request_timeout_s: float = 600.0
    population: Population = field(init=False)
    records: list[RequestRecord] = field(default_factory=list)
    conversations: dict[str, Conversation] = field(default_factory=dict)
    _began: float = field(default=0.0, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _open: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Condition = field(default_factory=threading.Condition, init=False)
    _in_flight: int = field(default=0, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.population = Population.of(self.shape)
        for conv in self.population.conversations:
            self.conversations[conv.cid] = conv
        self._open.set()

    # -- control ---------------------------------------------------------------------------

    def start(self) -> None:
        self._began = time.monotonic()
        for user in range(self.shape.users):
            thread = threading.Thread(target=self._user, args=(user,), name=f"user-{user}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def elapsed(self) -> float:
        return time.monotonic() - self._began

    def stop(self, timeout_s: float = 900.0) -> None:
        """Stop sending; wait for the requests in flight to be answered."""
        self._stop.set()
        self._open.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"users still waiting for answers after {timeout_s:.0f}s: {alive}")

    def pause(self, timeout_s: float = 900.0) -> None:
        """Hold new requests and wait until none is in flight."""
        self._open.clear()
        with self._lock:
            if not self._lock.wait_for(lambda: self._in_flight == 0, timeout_s):
                raise TimeoutError(f"{self._in_flight} requests still in flight "
                                   f"after {timeout_s:.0f}s")

    def resume(self, base_url: str | None = None) -> None:
        if base_url is not None:
            self.base_url = base_url
        self._open.set()

    # -- a user ----------------------------------------------------------------------------

    def _user(self, user: int) -> None:
        rng = random.Random(f"{self.shape.seed}/user/{user}")
        ranks = self.population.owned_by(user)
        visits = dict.fromkeys(ranks, 0)
        while not self._stop.is_set():
            if self._stop.wait(think_time(rng, self.shape.think_s)):
                return
            rank = rng.choices(ranks, weights=[self.population.conversations[r].weight
                                               for r in ranks])[0]
            if not self.population.fits(rank, visits[rank]):
                conv = self.population.retire(rank)
                with self._lock:
                    self.conversations[conv.cid] = conv
                visits[rank] = 0
            if self._send(user, self.population.conversations[rank], visits[rank]):
                visits[rank] += 1

    def _admit(self) -> bool:
        """Wait until requests may start; count this one in flight (False: stopping)."""
        while True:
            self._open.wait()
            with self._lock:
                if self._stop.is_set():
                    return False
                if self._open.is_set():
                    self._in_flight += 1
                    return True

    def _send(self, user: int, conv: Conversation, turn: int) -> bool:
        if not self._admit():
            return False
        started = self.elapsed()
        try:
            answer = stream_chat(self.base_url, conv.messages(turn, self.shape.turn_tokens),
                                 max_tokens=self.shape.max_tokens_out,
                                 timeout=self.request_timeout_s,
                                 model=conv.model or self.served_model, cache_salt=conv.salt,
                                 token_ids=True)
            record = RequestRecord(0, user, conv.cid, turn, started, answer.prompt_tokens,
                                   answer.cached_tokens, answer.ttft_s, answer.seconds,
                                   tuple(answer.tokens), tuple(answer.logprobs),
                                   tuple(answer.token_times))
            if not answer.tokens:
                record = RequestRecord(0, user, conv.cid, turn, started,
                                       error="answered with no token")
        except Exception as exc:  # every failure is a finding, recorded
            record = RequestRecord(0, user, conv.cid, turn, started,
                                   error=f"{type(exc).__name__}: {exc}"[:500])
        with self._lock:
            self.records.append(dataclasses.replace(record, seq=len(self.records)))
            self._in_flight -= 1
            self._lock.notify_all()
        return record.error is None

