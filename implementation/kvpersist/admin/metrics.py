"""``kvp-admin metrics``: a report as Prometheus text (for ``--textfile`` or ``--serve``), joined
with the LMCache server's own metrics.

The server's admin API listens on a Unix-domain socket (docs/security.md), which
Prometheus cannot scrape; ``kvp-admin metrics`` relays the server's ``lmcache_mp_*`` and
``kvpersist_l2_*`` families, read-only, next to its own ``kvpersist_*`` figures.  Only those
prefixes pass: the server's ``process_*``/``python_*`` families would collide with a
node_exporter's own in a textfile.  ``kvpersist_server_up`` says whether the relay had a server
to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic import write_text_atomic


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(report: dict[str, Any]) -> str:
    """Prometheus text exposition of a report (bytes and files per namespace, classes, budget)."""
    lines = [
        "# HELP kvpersist_budget_bytes Hard cap of the L2 tier (KVP_CACHE_BUDGET_GB).",
        "# TYPE kvpersist_budget_bytes gauge",
        f"kvpersist_budget_bytes {report['budget_bytes']}",
        "# HELP kvpersist_cache_bytes Bytes of KV files under the root (live, temp, quarantine).",
        "# TYPE kvpersist_cache_bytes gauge",
        f"kvpersist_cache_bytes {report['cache_bytes']}",
        "# HELP kvpersist_budget_share Share of the budget used by the cache.",
        "# TYPE kvpersist_budget_share gauge",
        f"kvpersist_budget_share {report['budget_share']:.6f}",
        "# HELP kvpersist_namespace_bytes Bytes of live KV files per namespace.",
        "# TYPE kvpersist_namespace_bytes gauge",
    ]
    for row in report["namespaces"]:
        labels = (f'namespace="{_label(row["namespace"])}",'
                  f'model_id="{_label(",".join(row["model_ids"]))}",state="{row["state"]}"')
        lines.append(f"kvpersist_namespace_bytes{{{labels}}} {row['bytes']}")
    lines += ["# HELP kvpersist_namespace_files Live KV files per namespace.",
              "# TYPE kvpersist_namespace_files gauge"]
    for row in report["namespaces"]:
        lines.append(f'kvpersist_namespace_files{{namespace="{_label(row["namespace"])}"}} '
                     f"{row['files']}")
    lines += ["# HELP kvpersist_class_bytes Bytes per file class under the root.",
              "# TYPE kvpersist_class_bytes gauge"]
    for cls, v in report["classes"].items():
        lines.append(f'kvpersist_class_bytes{{class="{cls}"}} {v["bytes"]}')
    lines += ["# HELP kvpersist_class_files Files per class under the root.",
              "# TYPE kvpersist_class_files gauge"]
    for cls, v in report["classes"].items():
        lines.append(f'kvpersist_class_files{{class="{cls}"}} {v["files"]}')
    lines += ["# HELP kvpersist_quarantine_files Files in quarantine.",
              "# TYPE kvpersist_quarantine_files gauge",
              f"kvpersist_quarantine_files {report['classes']['quarantine']['files']}"]
    return "\n".join(lines) + "\n"


#: Families of the server's /metrics that are relayed.
SERVER_PREFIXES = ("lmcache_mp_", "kvpersist_l2_")


def _family(line: str) -> str:
    if line.startswith("# HELP ") or line.startswith("# TYPE "):
        return line.split()[2]
    return line.split("{", 1)[0].split(" ", 1)[0]


def relay_server_metrics(text: str | None) -> str:
    """The relayed part of the server's metrics page, and ``kvpersist_server_up``."""
    lines = ["# HELP kvpersist_server_up 1 when the LMCache server answered /metrics.",
             "# TYPE kvpersist_server_up gauge", f"kvpersist_server_up {0 if text is None else 1}"]
    for line in (text or "").splitlines():
        if line and (not line.startswith("#") or line.startswith(("# HELP ", "# TYPE "))) \
                and _family(line).startswith(SERVER_PREFIXES):
            lines.append(line)
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Atomic write for node_exporter's textfile collector (readable by it: mode 0644)."""
    write_text_atomic(path, text, mode=0o644)
