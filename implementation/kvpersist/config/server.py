"""Settings of the LMCache MP server with a kvpersist L2 tier: defaults, the template file and the
environment, validated up front.

Invariants
----------
* Every value is validated before anything starts; a bad value raises :class:`SettingsError`
  whose message names the variable, the bad value and what is expected.
* Precedence: explicit overrides > process environment > the template ``lmcache-server.env``
  (package data, :data:`SERVER_TEMPLATE`) > built-in defaults.  The same precedence serves the
  launcher, the demo and the tests.
* Servers bind 127.0.0.1 unless ``KVP_BIND_HOST`` says otherwise; a non-loopback bind is
  allowed but reported by :func:`bind_warning`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import values
from .adapters import known_adapters
from .envfile import EnvLineError, parse_env_lines
from .paths import SERVER_TEMPLATE
from .values import SettingsError as SettingsError

DEFAULTS: dict[str, str] = {
    "KVP_CACHE_ROOT": "/var/lib/kvpersist/cache",
    "KVP_L1_SIZE_GB": "64",
    "KVP_CACHE_BUDGET_GB": "1500",
    "KVP_BIND_HOST": "127.0.0.1",
    "KVP_ZMQ_PORT": "5555",
    "KVP_HTTP_PORT": "8080",
    "KVP_L2_ADAPTER": "kvpersist",
    "KVP_L2_SHARDED": "false",
    "KVP_EVICTION_WATERMARK": "0.9",
    "KVP_EVICTION_RATIO": "0.1",
    "KVP_CHUNK_SIZE": "256",
    "KVP_START_TIMEOUT_S": "120",
    "KVP_STOP_TIMEOUT_S": "30",
}

PID_FILE_NAME = "lmcache-server.pid"
LOG_FILE_NAME = "lmcache-server.log"


def parse_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines; comments, blanks, ``export`` and matching quotes are allowed."""
    try:
        return {key: value for _, key, value in
                parse_env_lines(path.read_text(encoding="utf-8"), str(path))}
    except EnvLineError as exc:
        raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class ServerSettings:
    """Validated settings of one LMCache MP server with a kvpersist L2 tier."""

    cache_root: Path
    l1_size_gb: float
    budget_gb: float
    bind_host: str
    zmq_port: int
    http_port: int
    l2_adapter: str
    l2_sharded: bool
    eviction_watermark: float
    eviction_ratio: float
    chunk_size: int
    start_timeout_s: float
    stop_timeout_s: float

    @property
    def pid_file(self) -> Path:
        return self.cache_root / PID_FILE_NAME

    @property
    def log_file(self) -> Path:
        return self.cache_root / LOG_FILE_NAME

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "localhost") else self.bind_host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.http_port}"

    @property
    def zmq_url(self) -> str:
        host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "localhost") else self.bind_host
        return f"tcp://{host}"


def load_settings(
    overrides: Mapping[str, str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = SERVER_TEMPLATE,
) -> ServerSettings:
    """Resolve and validate settings (see the module docstring for precedence)."""
    merged: dict[str, str] = dict(DEFAULTS)
    if config_file is not None and config_file.is_file():
        merged.update({k: v for k, v in parse_env_file(config_file).items() if k in DEFAULTS})
    env = os.environ if environ is None else environ
    merged.update({k: env[k] for k in DEFAULTS if k in env and env[k] != ""})
    if overrides:
        unknown = sorted(set(overrides) - set(DEFAULTS))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        merged.update(overrides)
    adapter = merged["KVP_L2_ADAPTER"].strip()
    if adapter not in known_adapters():
        raise SettingsError(
            f"KVP_L2_ADAPTER={adapter!r} is not known; choose one of {', '.join(known_adapters())}"
        )
    root_raw = merged["KVP_CACHE_ROOT"].strip()
    if not root_raw:
        raise SettingsError("KVP_CACHE_ROOT is empty; set it to a directory on the NVMe tier")
    settings = ServerSettings(
        cache_root=Path(root_raw).expanduser().absolute(),
        l1_size_gb=values.positive_float("KVP_L1_SIZE_GB", merged["KVP_L1_SIZE_GB"]),
        budget_gb=values.positive_float("KVP_CACHE_BUDGET_GB", merged["KVP_CACHE_BUDGET_GB"]),
        bind_host=values.host("KVP_BIND_HOST", merged["KVP_BIND_HOST"]),
        zmq_port=values.port("KVP_ZMQ_PORT", merged["KVP_ZMQ_PORT"]),
        http_port=values.port("KVP_HTTP_PORT", merged["KVP_HTTP_PORT"]),
        l2_adapter=adapter,
        l2_sharded=values.boolean("KVP_L2_SHARDED", merged["KVP_L2_SHARDED"]),
        eviction_watermark=values.fraction("KVP_EVICTION_WATERMARK", merged["KVP_EVICTION_WATERMARK"]),
        eviction_ratio=values.fraction("KVP_EVICTION_RATIO", merged["KVP_EVICTION_RATIO"]),
        chunk_size=values.positive_int("KVP_CHUNK_SIZE", merged["KVP_CHUNK_SIZE"]),
        start_timeout_s=values.positive_float("KVP_START_TIMEOUT_S", merged["KVP_START_TIMEOUT_S"]),
        stop_timeout_s=values.positive_float("KVP_STOP_TIMEOUT_S", merged["KVP_STOP_TIMEOUT_S"]),
    )
    if settings.zmq_port == settings.http_port:
        raise SettingsError(
            f"KVP_ZMQ_PORT and KVP_HTTP_PORT are both {settings.zmq_port}; they must differ"
        )
    return settings


def bind_warning(settings: ServerSettings) -> str | None:
    """A warning text when the server would listen beyond loopback, else None."""
    if values.is_loopback(settings.bind_host):
        return None
    return (
        f"WARNING: the LMCache server will listen on {settings.bind_host} (not loopback): "
        "its ZMQ and HTTP APIs have no authentication; expose them only on a trusted network"
    )
