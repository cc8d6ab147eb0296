"""The connector's reading of LMCache's heartbeat, shared by the scheduler and worker sides."""

from __future__ import annotations


def dead_after_s(heartbeat_s: float) -> float:
    """How long the heartbeat must say *unhealthy* without a break before a live-looking
    server is taken for dead: several missed beats, and never under 5 s."""
    return max(3 * heartbeat_s, 5.0)
