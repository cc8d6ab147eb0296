"""The identity gate: whether one vLLM connector instance may cache, decided without vLLM imports.

Invariants
----------
* ``KVP_CACHE_BYPASS`` (``kvpersist.cache_bypass``) is decided after the identity: a bypassed
  engine still resolves (and records) its identity, so a bypass never hides an identity
  problem, but the server is not contacted.
* A server that does not answer at start closes the gate only when the server's chunk size is
  unknown (``kvpersist.chunk_size``, written by the launcher); otherwise the decision is
  "attach late" (:mod:`kvpersist.serving.late_attach`).
* Fail closed: caching is on only if the connector options parse, the identity derived from the
  running engine is complete and agrees with the pins, and the LMCache server answers; any
  other outcome is a :class:`GateDecision` that is off and whose ``reason`` names the setting,
  the identity field or the server.  Nothing here raises: a typo in a setting turns caching
  off and vLLM keeps serving.
* The same inputs give the same decision in every process of an engine (scheduler and each
  worker); where the server's answer differs between them, the connector reconciles through
  vLLM's worker→scheduler handshake (see :mod:`kvpersist.serving.connector`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..config.client import ConnectorOptions
from ..config.values import SettingsError
from ..identity import CacheIdentity, IdentityError, IdentityResolution, load_pins, merge_sources
from ..identity.records import write_record
from ..identity.sources import from_vllm_config
from . import http

SERVER_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class GateDecision:
    """Caching on (``identity`` and ``options`` set, ``reason`` None) or off (``reason``)."""

    identity: CacheIdentity | None
    options: ConnectorOptions | None
    reason: str | None
    bypass: bool = False
    #: caching on, but the server did not answer at start: attach when it does
    attach_late: bool = False

    @property
    def enabled(self) -> bool:
        return self.reason is None

    @classmethod
    def off(cls, reason: str, options: ConnectorOptions | None = None) -> GateDecision:
        return cls(None, options, reason)


def extra_config(vllm_config: Any) -> Mapping[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) if ktc is not None else None
    return extra if isinstance(extra, Mapping) else {}


def resolve_engine_identity(vllm_config: Any, options: ConnectorOptions) -> IdentityResolution:
    """The identity of the running engine, checked against its pins; never raises."""
    if options.pins is None:
        return IdentityResolution(None, [
            "no identity pins configured (set kvpersist.pins in kv_connector_extra_config "
            "or KVP_IDENTITY_PINS to configs/<model>/identity.env)"
        ])
    try:
        pins = load_pins(options.pins)
        live = from_vllm_config(vllm_config, chat_template_file=options.chat_template_file)
    except (IdentityError, OSError, ValueError) as exc:
        return IdentityResolution(None, [str(exc)])
    return merge_sources(pins, live, live_label="engine")


def server_answers(options: ConnectorOptions) -> bool | str:
    """True if the LMCache server's ``/healthcheck`` answers (True when no URL is known);
    False when it does not; the reason when this account may not use it."""
    if options.http_url is None:
        return True
    try:
        resp = http.get(options.http_url.rstrip("/") + "/healthcheck",
                        timeout=SERVER_PROBE_TIMEOUT_S)
    except http.AccessDenied as exc:
        return f"{exc} (this process runs as uid {os.geteuid()})"
    except http.HttpError:
        return False
    return resp.status == 200


def pipeline_stage_layers(vllm_config: Any) -> list[int]:
    """The number of layers each pipeline stage holds, as vLLM splits them (its own
    ``get_layers_start_end_indices``, so ``VLLM_PP_LAYER_PARTITION`` counts)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    sizes = []
    for stage in range(pp):
        start, end = mc.get_layers_start_end_indices(
            SimpleNamespace(rank=stage * tp, tensor_parallel_size=tp, pipeline_parallel_size=pp))
        sizes.append(int(end) - int(start))
    return sizes


def uneven_pipeline_split(vllm_config: Any) -> str | None:
    """Why a pipeline-parallel layout cannot be cached, or None.  LMCache 0.5.6 keeps one KV
    layout per model and world size and sizes every rank's transfer buffers from it, so stages
    with different layer counts would get buffers of the wrong length (and a valid file would
    fail its length check): refused before anything is stored."""
    if int(vllm_config.parallel_config.pipeline_parallel_size) <= 1:
        return None
    sizes = pipeline_stage_layers(vllm_config)
    if len(set(sizes)) == 1:
        return None
    return (f"pipeline parallel size {len(sizes)} splits the model's {sum(sizes)} layers "
            f"unevenly ({', '.join(map(str, sizes))} per stage); LMCache sizes every rank's KV "
            "transfer from one layout, so such a layout cannot be cached: use a pipeline size "
            "that divides the layer count (or an even VLLM_PP_LAYER_PARTITION)")


def decide(vllm_config: Any, *, environ: Mapping[str, str] | None = None,
           probe: Callable[[ConnectorOptions], bool | str] = server_answers) -> GateDecision:
    """Open or close the gate for one connector instance (see module invariants)."""
    try:
        options = ConnectorOptions.from_extra_config(extra_config(vllm_config), environ)
    except SettingsError as exc:
        return GateDecision.off(f"bad setting {exc}")
    uneven = uneven_pipeline_split(vllm_config)
    if uneven is not None:
        return GateDecision.off(uneven, options)
    resolution = resolve_engine_identity(vllm_config, options)
    if not resolution.enabled or resolution.identity is None:
        return GateDecision.off(resolution.summary(), options)
    if options.bypass:
        return GateDecision(resolution.identity, options, None, bypass=True)
    answer = probe(options)
    if isinstance(answer, str):
        return GateDecision.off(answer, options)
    if not answer:
        if options.chunk_size is not None:
            return GateDecision(resolution.identity, options, None, attach_late=True)
        return GateDecision.off("the LMCache server does not answer at start (and "
                                "kvpersist.chunk_size is not set, so the engine cannot attach "
                                "later: restart vLLM after the server)", options)
    return GateDecision(resolution.identity, options, None)


def record_identity(options: ConnectorOptions, identity: CacheIdentity) -> Path | str | None:
    """Record ``identity`` under the cache root when that is a local directory.  Returns the
    record's path, None when there is no local root, or the reason it could not be written."""
    root = options.cache_root
    if root is None or not Path(root).is_dir():
        return None
    try:
        return write_record(root, identity)
    except (OSError, IdentityError) as exc:
        return f"could not record the identity of {identity.namespace} under {root}: {exc}"
