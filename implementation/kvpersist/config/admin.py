"""Settings of the operator's tool (``kvp-admin``) beyond the server's.

Invariant: read once per command from the environment and validated; a bad value raises
:class:`SettingsError` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import values

WALKERS = ("auto", "c", "python")


@dataclass(frozen=True)
class AdminSettings:
    quotas_file: Path | None  # None: KVP_CACHE_ROOT/quotas.json
    walker: str  # "auto": the C walker when it is built
    walk_threads: int  # 0: one per CPU, at most 8
    cache_device: Path | None  # None: the cache root's device


def load_admin_settings(environ: Mapping[str, str] | None = None) -> AdminSettings:
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        return values.present(env, name)

    quotas, device = get("KVP_QUOTAS_FILE"), get("KVP_CACHE_DEVICE")
    return AdminSettings(
        quotas_file=Path(quotas) if quotas else None,
        walker=values.choice("KVP_WALKER", get("KVP_WALKER") or "auto", WALKERS),
        walk_threads=values.integer("KVP_WALK_THREADS", get("KVP_WALK_THREADS") or "0",
                                    minimum=0),
        cache_device=Path(device) if device else None,
    )
