"""Drive the whole stack as real processes with the tiny model: vLLM through our launcher, chats.

Used by the CPU demo and the end-to-end tests, so both exercise exactly what an operator runs
(``kvp-vllm``, which ``scripts/run-vllm-with-persist.sh`` wraps).  The engine-independent parts
(the HTTP client, the process handle) are :mod:`kvpersist.serving.launcher.vllm_client`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config.environment import process_env
from ..config.registry import DEFAULT_CHUNK_TOKENS
from ..serving.launcher.vllm_client import KVP_VLLM, VllmServer
from ..serving.launcher.vllm_client import ChatResult as ChatResult
from ..serving.launcher.vllm_client import chat as chat
from ..serving.launcher.vllm_client import free_port as free_port
from ..serving.launcher.vllm_client import http_json as http_json
from ..serving.launcher.vllm_client import metric_sum as metric_sum

LAUNCHER = KVP_VLLM
SERVED_MODEL_NAME = "tiny"
PREFILL_STEP_TOKENS = DEFAULT_CHUNK_TOKENS  # one LMCache chunk per prefill step


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


#: vLLM's compilation level "none": the model runs eagerly.  A start then skips torch.compile
#: (on 2 cores the compile, or the load of a cached graph, is a quarter of a start); the KV the
#: engine computes is the same kind of KV, and cold and warm runs within one engine compare
#: bit for bit as before.  Tests whose subject is the compiled model pass ``compile=True``, and
#: so must pipeline parallelism: vLLM 0.32 on CPU cannot run PP eagerly (its later stage finds
#: no intermediate-tensor buffer).
EAGER_ARGS = ("--compilation-config", '{"mode": 0}')


@dataclass
class VllmProcess(VllmServer):
    """vLLM's OpenAI server for the tiny ``model_dir``, started through our launcher.

    ``compile=False`` (the default, for tests) runs the model eagerly (:data:`EAGER_ARGS`);
    the demo and the benchmarks pass ``compile=True``, vLLM's own default.  Every engine a
    test compares must use the same setting."""

    model_dir: Path = Path()
    pins: Path = Path()
    server_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    kv_persist: bool = True
    max_model_len: int = 2048
    compile: bool = False
    dtype: str = "float32"

    def __init__(self, model_dir: Path, pins: Path, log_path: Path, server_env: dict[str, str],
                 *, extra_args: list[str] | None = None, kv_persist: bool = True,
                 max_model_len: int = 2048, port: int | None = None,
                 compile: bool = False, dtype: str = "float32") -> None:
        super().__init__(log_path, port if port is not None else free_port())
        self.model_dir, self.pins, self.server_env = model_dir, pins, server_env
        self.extra_args = list(extra_args or [])
        self.kv_persist, self.max_model_len, self.compile = kv_persist, max_model_len, compile
        self.dtype = dtype

    def command(self) -> list[str]:
        return [*LAUNCHER, str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", SERVED_MODEL_NAME,
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                # Prefill in steps of one LMCache chunk: a cold request then computes the tail
                # after the last full chunk exactly as a warm request (prefix loaded from L2)
                # does, so the two give bit-identical logprobs, not merely close ones.
                "--max-num-batched-tokens", str(PREFILL_STEP_TOKENS),
                *(() if self.compile else EAGER_ARGS), *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = process_env(None, **self.server_env)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["KV_PERSIST"] = "1" if self.kv_persist else "0"
        env["KVP_IDENTITY_PINS"] = str(self.pins)
        return env

