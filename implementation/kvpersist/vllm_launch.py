"""The ``--kv-transfer-config`` that puts vLLM on the kvpersist connector.

Invariants
----------
* The connector is always ``KvPersistConnector`` from ``kvpersist.connector`` (fail-closed
  identity gate over LMCache's MP connector); the pins file is always passed, as an
  absolute path, so scheduler and workers resolve the same identity.
* The LMCache server address comes from the same settings as the server launcher
  (``KVP_BIND_HOST``, ``KVP_ZMQ_PORT``), so the two cannot drift apart.
* A dead cache service is noticed within ``KVP_HEARTBEAT_S`` (default 2 s; LMCache's default is
  10 s) and a request waits at most ``KVP_LOOKUP_TIMEOUT_S`` (5 s) for its lookup; blocking
  LMCache calls (registration, shutdown) give up after ``KVP_MQ_TIMEOUT_S`` (15 s; LMCache: 300 s).
* On a machine without CUDA the transfer mode is ``engine_driven``: ``lmcache_driven`` leaves
  a 1 GiB ``/dev/shm`` segment per vLLM run there.  ``KVP_MP_TRANSFER_MODE`` overrides.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from .connector_names import CONNECTOR_CLASS, CONNECTOR_MODULE
from .settings import ServerSettings, load_settings


def default_transfer_mode() -> str:
    override = os.environ.get("KVP_MP_TRANSFER_MODE")
    if override:
        return override
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: certainly no CUDA transfer path
        has_cuda = False
    return "auto" if has_cuda else "engine_driven"


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def kv_transfer_config(
    settings: ServerSettings,
    pins: str | Path,
    *,
    chat_template_file: str | None = None,
    transfer_mode: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    pins_path = Path(pins).absolute()
    if not pins_path.is_file():
        raise FileNotFoundError(f"identity pins file {pins_path} does not exist")
    extra_config: dict[str, Any] = {
        "lmcache.mp.host": settings.zmq_url,
        "lmcache.mp.port": settings.zmq_port,
        "lmcache.mp.mp_transfer_mode": transfer_mode or default_transfer_mode(),
        "lmcache.mp.heartbeat_interval": _env_seconds("KVP_HEARTBEAT_S", 2.0),
        "lmcache.mp.mq_timeout": _env_seconds("KVP_MQ_TIMEOUT_S", 15.0),
        "kvpersist.pins": str(pins_path),
        "kvpersist.http_url": settings.http_url,
        "kvpersist.cache_root": str(settings.cache_root),
        "kvpersist.lookup_timeout_s": _env_seconds("KVP_LOOKUP_TIMEOUT_S", 5.0),
    }
    if chat_template_file:
        extra_config["kvpersist.chat_template_file"] = str(Path(chat_template_file).absolute())
    if extra:
        extra_config.update(extra)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.vllm_launch",
        description="Print the --kv-transfer-config JSON for vLLM with the kvpersist connector. "
        "Server address from KVP_BIND_HOST/KVP_ZMQ_PORT (configs/generic/lmcache-server.env).",
    )
    parser.add_argument("--pins", required=True, help="configs/<model>/identity.env")
    parser.add_argument("--chat-template", help="the --chat-template file given to vLLM, if any")
    args = parser.parse_args(argv)
    config = kv_transfer_config(load_settings(), args.pins, chat_template_file=args.chat_template)
    print(json.dumps(config, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
