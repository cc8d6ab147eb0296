"""Settings of the vLLM side: the launcher's ``KVP_*``/``KV_PERSIST`` variables and the
connector's ``kvpersist.*`` keys of ``kv_connector_extra_config``.

Invariants
----------
* Every value is parsed here, by the parsers of :mod:`kvpersist.config.values`; a malformed
  value raises :class:`SettingsError` naming the key (``kvpersist.lookup_timeout_s``) or the
  variable (``KVP_LOOKUP_TIMEOUT_S``).  The connector turns that error into "caching off", so a
  typo never crashes vLLM.
* A connector option comes from the extra config when it is set there, else from its
  environment variable or the site file (:mod:`kvpersist.config.site`), else from its
  default: the launcher writes the extra config from the same variables, so an engine started
  either way resolves the same options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import values
from .registry import default_of
from .site import effective_environ
from .values import SettingsError

#: The module and class vLLM loads; deployments name them, so they never change.
CONNECTOR_MODULE = "kvpersist.connector"
CONNECTOR_CLASS = "KvPersistConnector"
TRANSFER_MODES = ("auto", "engine_driven", "lmcache_driven")

PINS_KEY = "kvpersist.pins"
CHAT_TEMPLATE_KEY = "kvpersist.chat_template_file"
HTTP_URL_KEY = "kvpersist.http_url"
CACHE_ROOT_KEY = "kvpersist.cache_root"
LOOKUP_TIMEOUT_KEY = "kvpersist.lookup_timeout_s"
LOOKUP_MAX_KEY = "kvpersist.lookup_max_s"
BYPASS_KEY = "kvpersist.cache_bypass"
CHUNK_SIZE_KEY = "kvpersist.chunk_size"

# The defaults are the registry's (kvpersist.config.registry), parsed once.
DEFAULT_LOOKUP_TIMEOUT_S = float(default_of("KVP_LOOKUP_TIMEOUT_S"))  # without progress
DEFAULT_LOOKUP_MAX_S = float(default_of("KVP_LOOKUP_MAX_S"))  # progressing or not
DEFAULT_HEARTBEAT_S = float(default_of("KVP_HEARTBEAT_S"))
DEFAULT_MQ_TIMEOUT_S = float(default_of("KVP_MQ_TIMEOUT_S"))

# Connector option → (its environment variable, or None).
_OPTION_ENV: dict[str, str] = {
    PINS_KEY: "KVP_IDENTITY_PINS",
    CHAT_TEMPLATE_KEY: "KVP_CHAT_TEMPLATE_FILE",
    HTTP_URL_KEY: "KVP_SERVER_HTTP_URL",
    CACHE_ROOT_KEY: "KVP_CACHE_ROOT",
    LOOKUP_TIMEOUT_KEY: "KVP_LOOKUP_TIMEOUT_S",
    LOOKUP_MAX_KEY: "KVP_LOOKUP_MAX_S",
    BYPASS_KEY: "KVP_CACHE_BYPASS",
    CHUNK_SIZE_KEY: "KVP_CHUNK_SIZE",
}
KNOWN_OPTIONS = tuple(_OPTION_ENV)


def _raw(extra: Mapping[str, Any], environ: Mapping[str, str], key: str) -> tuple[str, Any]:
    """(label naming where the value came from, value or None)."""
    value = extra.get(key)
    if value not in (None, ""):
        return key, value
    env = _OPTION_ENV[key]
    return env, values.present(environ, env)


@dataclass(frozen=True)
class ConnectorOptions:
    """The ``kvpersist.*`` options one connector instance runs with (validated)."""

    pins: str | None = None
    chat_template_file: str | None = None
    http_url: str | None = None
    cache_root: str | None = None
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    lookup_max_s: float = DEFAULT_LOOKUP_MAX_S
    #: ``KVP_CACHE_BYPASS``: the connector stays loaded and resolves and records the identity,
    #: but never looks up or stores (an A/B switch without changing the recipe).
    bypass: bool = False
    #: The server's chunk size (``KVP_CHUNK_SIZE``): lets an engine started before the server
    #: attach later (see :mod:`kvpersist.serving.connector.scheduler.late_attach`); None: the
    #: engine must find the server at start.
    chunk_size: int | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> ConnectorOptions:
        """Parse the ``kvpersist.*`` keys; SettingsError names the first bad or unknown one."""
        extra = dict(extra or {})
        env = effective_environ(environ)
        unknown = sorted(k for k in extra if k.startswith("kvpersist.") and k not in KNOWN_OPTIONS)
        if unknown:
            raise SettingsError(f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                                f"known: {', '.join(KNOWN_OPTIONS)}")
        texts: dict[str, str | None] = {}
        for key in (PINS_KEY, CHAT_TEMPLATE_KEY, HTTP_URL_KEY, CACHE_ROOT_KEY):
            label, value = _raw(extra, env, key)
            if value is not None and not isinstance(value, str):
                raise SettingsError(f"{label}={value!r} must be a string")
            texts[key] = value
        label, timeout = _raw(extra, env, LOOKUP_TIMEOUT_KEY)
        max_label, ceiling = _raw(extra, env, LOOKUP_MAX_KEY)
        bypass_label, bypass = _raw(extra, env, BYPASS_KEY)
        chunk_label, chunk = _raw(extra, env, CHUNK_SIZE_KEY)
        options = cls(
            pins=texts[PINS_KEY], chat_template_file=texts[CHAT_TEMPLATE_KEY],
            http_url=texts[HTTP_URL_KEY], cache_root=texts[CACHE_ROOT_KEY],
            lookup_timeout_s=(DEFAULT_LOOKUP_TIMEOUT_S if timeout is None
                              else values.positive_float(label, timeout)),
            lookup_max_s=(DEFAULT_LOOKUP_MAX_S if ceiling is None
                          else values.positive_float(max_label, ceiling)),
            bypass=False if bypass is None else values.boolean(bypass_label, bypass),
            chunk_size=None if chunk is None else values.positive_int(chunk_label, chunk),
        )
        if options.lookup_max_s < options.lookup_timeout_s:
            raise SettingsError(f"{max_label}={options.lookup_max_s:g} is below the lookup "
                                f"deadline {label}={options.lookup_timeout_s:g}")
        return options


@dataclass(frozen=True)
class LauncherSettings:
    """What ``kvp-vllm`` reads from the environment besides the server settings."""

    persist: bool
    identity_pins: str | None
    vllm_exec: str  # a command prefix, e.g. "docker exec <container>"
    python: str | None  # the Python with vLLM, LMCache and kvpersist (None: this one)
    lookup_timeout_s: float
    lookup_max_s: float
    heartbeat_s: float
    mq_timeout_s: float
    transfer_mode: str | None  # None: chosen from the machine (see serving.launcher)
    bypass: bool = False  # KVP_CACHE_BYPASS


def load_launcher_settings(environ: Mapping[str, str] | None = None) -> LauncherSettings:
    env = effective_environ(environ)

    def get(name: str) -> str | None:
        return values.present(env, name)

    def seconds(name: str, default: float) -> float:
        raw = get(name)
        return default if raw is None else values.positive_float(name, raw)

    mode = get("KVP_MP_TRANSFER_MODE")
    return LauncherSettings(
        persist=values.boolean("KV_PERSIST", get("KV_PERSIST") or default_of("KV_PERSIST")),
        identity_pins=get("KVP_IDENTITY_PINS"),
        vllm_exec=get("KVP_VLLM_EXEC") or "",
        python=get("KVP_PYTHON"),
        lookup_timeout_s=seconds("KVP_LOOKUP_TIMEOUT_S", DEFAULT_LOOKUP_TIMEOUT_S),
        lookup_max_s=seconds("KVP_LOOKUP_MAX_S", DEFAULT_LOOKUP_MAX_S),
        heartbeat_s=seconds("KVP_HEARTBEAT_S", DEFAULT_HEARTBEAT_S),
        mq_timeout_s=seconds("KVP_MQ_TIMEOUT_S", DEFAULT_MQ_TIMEOUT_S),
        transfer_mode=None if mode is None else values.choice("KVP_MP_TRANSFER_MODE", mode,
                                                              TRANSFER_MODES),
        bypass=values.boolean("KVP_CACHE_BYPASS",
                              get("KVP_CACHE_BYPASS") or default_of("KVP_CACHE_BYPASS")),
    )
