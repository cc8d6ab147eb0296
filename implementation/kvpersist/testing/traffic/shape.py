"""The shape of simulated traffic: who owns which conversation, how long each is, what each
request sends.

Invariants
----------
* Everything here is a pure function of the :class:`TrafficShape` (its ``seed`` included): two
  runs of one shape send the same prompts for the same (conversation, turn), so a turn can be
  asked again later (the wrong-answer sample) and the recorded trace replayed offline.
* Turn ``k`` of a conversation is a strict prefix of turn ``k + 1`` (the next turn appends the
  assistant's reply and a new user message): every full chunk of one turn is a chunk of the
  next.  Two conversations share no chunk (each begins with its own id).
* The tiny models' tokenizer is byte-level, so a character of ASCII content is one token: the
  lengths below are token counts to within the chat template's few tokens per message.
* A conversation whose next turn would not fit ``max_prompt_tokens`` is retired and replaced by
  a new one of the same owner (a user starting a new chat): its number of visits is bounded.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

#: Words the filler text is drawn from (ASCII, so one character is one token).
WORDS = ("cache", "chunk", "tier", "drive", "namespace", "restore", "prefill", "budget", "quota",
         "token", "layer", "engine", "server", "restart", "budget", "index", "scrub", "verify",
         "latency", "window", "tenant", "adapter", "history", "reply", "question", "answer",
         "model", "weights", "device", "pages", "stream", "decode", "record", "metric")


@dataclass(frozen=True)
class TrafficShape:
    """What the simulated population looks like (every length in tokens).

    ``min_tokens``/``max_tokens`` bound a conversation's history when its user first comes
    back to it, drawn from a Pareto law of index ``length_alpha`` (heavy-tailed: most chats are
    short, a few are near the maximum).  Each user owns ``conversations_per_user`` chats and
    returns to them with Zipf popularity of exponent ``zipf_s`` over the whole population (the
    most popular chats belong to few users), after exponential think times of mean
    ``think_s``.  A ``salted_fraction`` of conversations carries one of ``tenants`` cache salts;
    a ``lora_fraction`` is served by one of ``lora_adapters`` (model names vLLM serves)."""

    users: int = 8
    conversations_per_user: int = 3
    min_tokens: int = 1024
    max_tokens: int = 16384
    length_alpha: float = 1.1
    turn_tokens: int = 160
    max_prompt_tokens: int = 20000
    zipf_s: float = 1.0
    think_s: float = 2.0
    salted_fraction: float = 0.25
    tenants: int = 2
    lora_fraction: float = 0.0
    lora_adapters: tuple[str, ...] = ()
    max_tokens_out: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 1 or self.conversations_per_user < 1:
            raise ValueError("a shape needs at least one user with one conversation")
        if not 0 < self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} and max_tokens {self.max_tokens} "
                             "must satisfy 0 < min <= max")
        if self.max_tokens + 2 * self.turn_tokens > self.max_prompt_tokens:
            raise ValueError(f"max_prompt_tokens {self.max_prompt_tokens} leaves no room for "
                             f"two turns after a {self.max_tokens}-token history")
        if self.lora_fraction > 0 and not self.lora_adapters:
            raise ValueError("lora_fraction > 0 needs lora_adapters")


@dataclass(frozen=True)
class Conversation:
    """One chat: its owner, its tenant salt and adapter (None: unsalted, the base model), and
    the length of its history when first asked."""

    cid: str
    owner: int
    history_tokens: int
    salt: str | None
    model: str | None
    weight: float  # Zipf popularity, relative to the other conversations

    def messages(self, turn: int, turn_tokens: int) -> list[dict[str, str]]:
        """The chat as sent on visit ``turn`` (0: the history and a first question)."""
        rng = random.Random(f"{self.cid}/history")
        head = f"Conversation {self.cid}. You are the assistant of this chat."
        messages = [{"role": "system", "content": head},
                    {"role": "user", "content": _filler(rng, self.history_tokens)}]
        for k in range(turn):
            turn_rng = random.Random(f"{self.cid}/turn/{k}")
            messages.append({"role": "assistant", "content": _filler(turn_rng, turn_tokens // 3)})
            messages.append({"role": "user", "content": _filler(turn_rng, turn_tokens // 2)})
        return messages

    def prompt_tokens_estimate(self, turn: int, turn_tokens: int) -> int:
        """About how many tokens visit ``turn`` sends (content plus a few per message)."""
        return sum(len(m["content"]) + 3 for m in self.messages(turn, turn_tokens))


def _filler(rng: random.Random, tokens: int) -> str:
    words: list[str] = []
    length = 0
    while length < tokens:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:max(tokens, 1)]


def pareto_length(rng: random.Random, low: int, high: int, alpha: float) -> int:
    """A length from a Pareto law of index ``alpha`` with minimum ``low``, truncated at
    ``high`` (drawn by inverting the truncated law's distribution function)."""
    u = rng.random()
    ratio = (low / high) ** alpha
    length: float = low / (1 - u * (1 - ratio)) ** (1 / alpha)
    return round(length)


@dataclass
class Population:
    """The conversations of a shape and their owners; retiring a conversation replaces it."""

    shape: TrafficShape
    conversations: list[Conversation] = field(default_factory=list)
    _generation: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, shape: TrafficShape) -> Population:
        pop = cls(shape)
        total = shape.users * shape.conversations_per_user
        # rank r of the population (0 the most popular) goes to user r % users
        for rank in range(total):
            pop.conversations.append(pop._make(rank, owner=rank % shape.users, generation=0))
        return pop

    def _make(self, rank: int, owner: int, generation: int) -> Conversation:
        shape = self.shape
        rng = random.Random(f"{shape.seed}/conversation/{rank}/{generation}")
        length = pareto_length(rng, shape.min_tokens, shape.max_tokens, shape.length_alpha)
        salt = None
        if rng.random() < shape.salted_fraction:
            salt = f"tenant-{rng.randrange(shape.tenants)}"
        model = None
        if shape.lora_adapters and rng.random() < shape.lora_fraction:
            model = rng.choice(shape.lora_adapters)
        self._generation[rank] = generation
        return Conversation(f"c{rank}g{generation}s{shape.seed}", owner, length, salt, model,
                            1.0 / (rank + 1) ** shape.zipf_s)

    def owned_by(self, user: int) -> list[int]:
        """Ranks of ``user``'s conversations."""
        return [r for r, c in enumerate(self.conversations) if c.owner == user]

    def retire(self, rank: int) -> Conversation:
        """Replace conversation ``rank`` by a new one with the same owner and popularity."""
        old = self.conversations[rank]
        new = self._make(rank, old.owner, self._generation[rank] + 1)
        self.conversations[rank] = new
        return new

    def fits(self, rank: int, turn: int) -> bool:
        """Whether visit ``turn`` of conversation ``rank`` and its answer fit the context."""
        shape = self.shape
        need = self.conversations[rank].prompt_tokens_estimate(turn, shape.turn_tokens)
        return need + shape.max_tokens_out < shape.max_prompt_tokens


def think_time(rng: random.Random, mean_s: float) -> float:
    """An exponential think time of mean ``mean_s`` (0 when the mean is 0)."""
    return -mean_s * math.log(1.0 - rng.random()) if mean_s > 0 else 0.0
