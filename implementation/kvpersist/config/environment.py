"""The one place that builds the environment of the processes kvpersist starts.

Invariant: every LMCache and every vLLM process started by kvpersist (server, launcher, demo,
tests, benchmarks) gets its environment from :func:`process_env`, so telemetry is off and no
hub is contacted, whatever the caller's shell says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Telemetry off and no hub access, for every process of the stack.
TELEMETRY_OFF: dict[str, str] = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
#: LMCache prints a banner on every start otherwise.
LMCACHE_QUIET: dict[str, str] = {"LMCACHE_DISABLE_BANNER": "1"}


def process_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) plus ``extra``, with telemetry forced off
    (``extra`` cannot turn it back on)."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env.update(LMCACHE_QUIET)
    env.update(TELEMETRY_OFF)
    return env


def apply_to_current_process() -> None:
    """Force telemetry off in this process (for entry points that import LMCache or vLLM)."""
    os.environ.update(LMCACHE_QUIET)
    os.environ.update(TELEMETRY_OFF)
