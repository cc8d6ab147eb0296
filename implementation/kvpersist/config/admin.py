"""Settings of the operator's tool (``kvp-admin``) beyond the server's.

Invariant: read once per command from the environment over the site file
(:mod:`kvpersist.config.site`) and validated; a bad value raises
:class:`SettingsError` naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import values
from .registry import default_of
from .site import effective_environ

WALKERS = ("auto", "c", "python")


@dataclass(frozen=True)
class AdminSettings:
    quotas_file: Path | None  # None: KVP_CACHE_ROOT/quotas.json
    walker: str  # "auto": the C walker when it is built
    walk_threads: int  # 0: one per CPU, at most 8
    cache_mount: Path | None  # None: the cache root's file system
    block_device: str | None  # None: the device holding the cache root
    server_restart: str | None  # None: kvp-server stop, then start
    results_dir: Path | None  # None: next to the cache root


def load_admin_settings(environ: Mapping[str, str] | None = None) -> AdminSettings:
    env = effective_environ(environ)

    def get(name: str) -> str | None:
        return values.present(env, name)

    def get_or_default(name: str) -> str:
        return get(name) or default_of(name)

    quotas, mount, results = get("KVP_QUOTAS_FILE"), get("KVP_CACHE_MOUNT"), get("KVP_RESULTS_DIR")
    return AdminSettings(
        quotas_file=Path(quotas) if quotas else None,
        walker=values.choice("KVP_WALKER", get_or_default("KVP_WALKER"), WALKERS),
        walk_threads=values.integer("KVP_WALK_THREADS", get_or_default("KVP_WALK_THREADS"),
                                    minimum=0),
        cache_mount=Path(mount) if mount else None,
        block_device=get("KVP_CACHE_BLOCK_DEVICE"),
        server_restart=get("KVP_SERVER_RESTART"),
        results_dir=Path(results).expanduser().absolute() if results else None,
    )
