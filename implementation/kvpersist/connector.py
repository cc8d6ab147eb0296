"""kvpersist's vLLM KV connector: LMCache's MP connector behind a fail-closed identity gate.

Load it with ``--kv-transfer-config`` ``{"kv_connector": "KvPersistConnector",
"kv_connector_module_path": "kvpersist.connector", ...}`` (``scripts/run-vllm-with-persist.sh``
writes this).  Extra config keys, besides LMCache's own ``lmcache.mp.*``:

* ``kvpersist.pins``: path of the ``configs/<model>/identity.env`` pins (or env
  ``KVP_IDENTITY_PINS``).
* ``kvpersist.chat_template_file``: the ``--chat-template`` file the API server uses, if any
  (or env ``KVP_CHAT_TEMPLATE_FILE``).
* ``kvpersist.http_url``: the LMCache server's HTTP address, probed at start (2 s timeout).
* ``kvpersist.lookup_timeout_s``: the longest a request waits for the cache lookup (default 5).
* ``kvpersist.cache_root``: the server's ``KVP_CACHE_ROOT`` (or env ``KVP_CACHE_ROOT``); when it is
  a local directory, the scheduler records the identity there (:mod:`kvpersist.identity_records`).

Invariants
----------
* The identity is derived from the running engine's ``VllmConfig`` and checked against the
  pins, in every process that builds a connector (scheduler and each worker), the same way.
* With a complete, agreeing identity, LMCache sees ``<model id>/<namespace>`` as the model
  name, so every object key, and every L2 file name, carries the namespace.
* Otherwise the connector is a :class:`DisabledKvConnector`: it never contacts the LMCache
  server, reports no external hits, stores nothing, and logs which field turned it off.
  vLLM keeps serving.
* **A dead cache service never stalls serving.**  A request waits at most
  ``kvpersist.lookup_timeout_s`` for its lookup; then it bypasses the cache and is recomputed
  (LMCache's own path waits for ``lmcache.mp.mq_timeout``, 300 s by default, and vLLM's
  scheduler keeps later requests queued behind it).  LMCache's heartbeat marks the server
  unhealthy and, once it answers again, re-registers the KV caches, so caching resumes without
  restarting vLLM.
* vLLM started while the server is down serves without the cache (disabled connector).  Roles
  stay consistent: a worker that found the server down leaves a marker for its engine, and the
  scheduler, created after the workers, then disables itself too, so it can never promise hits
  that no worker would load.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from .identity import CacheIdentity, IdentityError, IdentityResolution, load_pins, merge_sources
from .identity_records import write_record
from .identity_sources import from_vllm_config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.kvpersist.connector")  # inherits vLLM's log handler

PINS_KEY = "kvpersist.pins"
CHAT_TEMPLATE_KEY = "kvpersist.chat_template_file"
HTTP_URL_KEY = "kvpersist.http_url"
LOOKUP_TIMEOUT_KEY = "kvpersist.lookup_timeout_s"
CACHE_ROOT_KEY = "kvpersist.cache_root"
DEFAULT_LOOKUP_TIMEOUT_S = 5.0


def _extra(vllm_config: Any, key: str, env: str) -> str | None:
    ktc = vllm_config.kv_transfer_config
    value = ktc.get_from_extra_config(key, None) if ktc is not None else None
    if value in (None, ""):
        value = os.environ.get(env) or None
    return None if value is None else str(value)


def resolve_engine_identity(vllm_config: Any) -> IdentityResolution:
    """The identity of the running engine, checked against its pins; never raises."""
    pins_path = _extra(vllm_config, PINS_KEY, "KVP_IDENTITY_PINS")
    if pins_path is None:
        return IdentityResolution(None, [
            f"no identity pins configured (set {PINS_KEY} in kv_connector_extra_config "
            "or KVP_IDENTITY_PINS to configs/<model>/identity.env)"
        ])
    try:
        pins = load_pins(pins_path)
        live = from_vllm_config(
            vllm_config, chat_template_file=_extra(vllm_config, CHAT_TEMPLATE_KEY,
                                                   "KVP_CHAT_TEMPLATE_FILE"))
    except (IdentityError, OSError, ValueError) as exc:
        return IdentityResolution(None, [str(exc)])
    return merge_sources(pins, live, live_label="engine")


def server_answers(vllm_config: Any, timeout: float = 2.0) -> bool:
    """True if the LMCache server's ``/healthcheck`` answers 200 (True when no URL is known)."""
    url = _extra(vllm_config, HTTP_URL_KEY, "KVP_SERVER_HTTP_URL")
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthcheck", timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def record_identity(vllm_config: Any, identity: CacheIdentity) -> Path | None:
    """Record ``identity`` under the cache root, if it is a local directory; never raises."""
    root = _extra(vllm_config, CACHE_ROOT_KEY, "KVP_CACHE_ROOT")
    if root is None or not Path(root).is_dir():
        return None
    try:
        return write_record(root, identity)
    except (OSError, IdentityError) as exc:
        logger.warning("kvpersist: could not record the identity of %s under %s: %s",
                       identity.namespace, root, exc)
        return None


def _down_marker(vllm_config: Any) -> Path:
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or "default"
    return Path(tempfile.gettempdir()) / f"kvpersist-server-down-{engine_id}"


def with_model_name(vllm_config: Any, model_name: str) -> Any:
    """A shallow copy of ``vllm_config`` whose ``model_config.model`` is ``model_name``.

    LMCache's connector takes its cache model name from ``model_config.model`` and reads
    nothing else from that attribute; all other config objects are shared, not copied.
    """
    cfg = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    object.__setattr__(model_config, "model", model_name)
    object.__setattr__(cfg, "model_config", model_config)
    return cfg


class _NoMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Metadata of a disabled connector: there is never anything to transfer."""


class DisabledKvConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A connector that does nothing: no hits, no stores, no server contact."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None,
                 *, reason: str = "") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.disabled_reason = reason

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class KvPersistConnector(LMCacheMPConnector):  # type: ignore[misc]
    """LMCache's MP connector with the namespace as model name, or disabled (fail closed)."""

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                ) -> Any:
        resolution = resolve_engine_identity(vllm_config)
        if not resolution.enabled:
            reason = resolution.summary()
            logger.error("kvpersist: %s (role %s); vLLM serves without the KV cache tier",
                         reason, getattr(role, "name", role))
            return DisabledKvConnector(vllm_config, role, kv_cache_config, reason=reason)
        role_name = getattr(role, "name", str(role))
        marker = _down_marker(vllm_config)
        if role_name == "SCHEDULER" and marker.exists():
            marker.unlink(missing_ok=True)
            reason = "a worker found the LMCache server down at start"
            logger.error("kvpersist: %s; vLLM serves without the KV cache tier", reason)
            return DisabledKvConnector(vllm_config, role, kv_cache_config, reason=reason)
        if not server_answers(vllm_config):
            reason = "the LMCache server does not answer at start"
            if role_name == "WORKER":
                marker.touch()
            logger.error("kvpersist: %s (role %s); vLLM serves without the KV cache tier",
                         reason, role_name)
            return DisabledKvConnector(vllm_config, role, kv_cache_config, reason=reason)
        if role_name == "WORKER":
            marker.unlink(missing_ok=True)
        instance = super().__new__(cls)
        instance._kvp_resolution = resolution
        return instance

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        resolution: IdentityResolution = self._kvp_resolution
        assert resolution.identity is not None
        self.kvp_identity = resolution.identity
        model_name = resolution.identity.lmcache_model_name()
        logger.info("kvpersist: caching ON, namespace %s, LMCache model name %s (role %s)",
                    resolution.identity.namespace, model_name, getattr(role, "name", role))
        super().__init__(with_model_name(vllm_config, model_name), role, kv_cache_config)
        if getattr(role, "name", None) == "SCHEDULER":  # one process per engine writes it
            record_identity(vllm_config, resolution.identity)
        raw = _extra(vllm_config, LOOKUP_TIMEOUT_KEY, "KVP_LOOKUP_TIMEOUT_S")
        self._kvp_lookup_timeout_s = float(raw) if raw is not None else DEFAULT_LOOKUP_TIMEOUT_S
        self._kvp_lookup_began: dict[str, float] = {}
        self.kvp_bypassed_requests = 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """LMCache's lookup, bounded by ``kvpersist.lookup_timeout_s``: past it, or while the
        heartbeat says the server is down, the request bypasses the cache (a recompute)."""
        rid = request.request_id
        began = self._kvp_lookup_began.setdefault(rid, time.monotonic())
        waited = time.monotonic() - began
        if waited > self._kvp_lookup_timeout_s or not self.scheduler_adapter.is_healthy:
            self._kvp_bypass(request, waited)
            return 0, False
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
        if result[0] is not None:
            self._kvp_lookup_began.pop(rid, None)
        return result

    def _kvp_bypass(self, request: Any, waited: float) -> None:
        rid = request.request_id
        self._kvp_lookup_began.pop(rid, None)
        tracker = self._get_or_create_request_tracker(request)
        if tracker.state == LMCacheMPRequestState.BYPASS_LMCACHE:
            return
        self.scheduler_adapter.cleanup_lookup_result(rid)
        tracker.num_lmcache_hit_tokens = 0
        tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
        self.kvp_bypassed_requests += 1
        logger.warning("kvpersist: request %s bypasses the KV cache after %.1fs (server %s); "
                       "it is recomputed", rid, waited,
                       "unhealthy" if not self.scheduler_adapter.is_healthy else "slow")

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._kvp_lookup_began.pop(request.request_id, None)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(request, block_ids)
        return result

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._kvp_lookup_began.pop(request.request_id, None)
        result: tuple[bool, dict[str, Any] | None] = super().request_finished_all_groups(
            request, block_ids)
        return result
