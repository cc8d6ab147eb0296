"""What a failed end-to-end test's process logs said, for the test report.

A CI run keeps only its printed output: the logs of the servers and vLLM processes a test
started live under its temporary directory and are gone with the clone.  A failure that does
not repeat on demand (a restore given up under load, a logprob off by 5e-4) is then explained
only if the report carries those logs' telling lines.

Invariants
----------
* Only files named ``*.log`` below the given directory are read, in name order, at most
  ``max_logs`` of them; a file that cannot be read is reported as such, never raised.
* From each log: the lines that carry one of :data:`TELLING` words (kvpersist's own lines, a
  bypassed lookup, LMCache's prefetch results, warnings and errors), at most ``max_lines`` of
  them, the latest kept; then the log's last ``tail_lines`` lines.  A line is cut at
  ``max_line_chars``.  The whole summary is bounded by these numbers, whatever the logs' sizes.
* Terminal colour codes are removed (LMCache colours its level names).
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

#: Words that make a log line worth a CI report (case-sensitive; the logs' own spellings).
TELLING = ("kvpersist", "bypass", "Prefetch request", "Retrieved", "Stored", "WARNING",
           "ERROR", "Error", "Traceback", "SIGKILL", "SIGTERM", "killed")

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def telling_lines(path: Path, *, max_lines: int = 25, tail_lines: int = 8,
                  max_line_chars: int = 300) -> list[str]:
    """The telling lines of one log, then its tail (see module invariants)."""
    telling: deque[str] = deque(maxlen=max_lines)
    tail: deque[str] = deque(maxlen=tail_lines)
    try:
        with path.open(encoding="utf-8", errors="replace") as log:
            for raw in log:
                line = _COLOUR.sub("", raw.rstrip("\n"))[:max_line_chars]
                if any(word in line for word in TELLING):
                    telling.append(line)
                tail.append(line)
    except OSError as exc:
        return [f"(cannot read: {exc})"]
    return [*telling, f"-- last {len(tail)} lines --", *tail]


def summarize(directory: Path, *, max_logs: int = 6, **limits: int) -> str:
    """Every ``*.log`` below ``directory``, each with its telling lines and tail; empty when
    there is none."""
    logs = sorted(directory.rglob("*.log"))[:max_logs]
    parts = []
    for path in logs:
        lines = telling_lines(path, **limits)
        parts.append(f"== {path.relative_to(directory)}\n" + "\n".join(lines))
    return "\n".join(parts)
