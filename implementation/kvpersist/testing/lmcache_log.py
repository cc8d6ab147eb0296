"""LMCache's own lines in vLLM's log that end-to-end tests wait on, and counting them.

They come from LMCache's MP connector inside vLLM (``lmcache.integration.vllm.
vllm_multi_process_adapter``): each heartbeat (the scheduler's, and one per worker) logs a
change of its verdict, and a worker logs the end of re-registering its KV caches with a server
that came back.  Each string occurs once in that module (``tests/test_lmcache_log.py`` checks
the installed LMCache), so a count of a line is a count of those events.
"""

from __future__ import annotations

from pathlib import Path

#: A heartbeat found the server down.
UNHEALTHY = "LMCache server is unhealthy — entering degraded mode"
#: A heartbeat found the server up again.
HEALTHY_AGAIN = "LMCache server is healthy again — resuming normal operation"
#: A worker re-registered its KV caches with the returned server.
REREGISTERED = "Finished re-registering KV caches after server recovery"
#: Where LMCache logs them.
SOURCE_MODULE = "lmcache.integration.vllm.vllm_multi_process_adapter"


def count(log: Path, line: str) -> int:
    """How many times ``line`` is in the log file ``log`` so far."""
    return log.read_text(errors="replace").count(line)
