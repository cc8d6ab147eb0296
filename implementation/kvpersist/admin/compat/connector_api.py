"""The connector's API surface: vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` compared with
:data:`TESTED_CONNECTOR_SURFACE` (recorded from vLLM 0.32.0) and with how ``kv_connector.py``
forwards (instance methods and properties forwarded to ``inner`` automatically, class and
static methods only where ``KvPersistConnector`` defines them).

Invariants
----------
* On the tested vLLM, :func:`connector_surface` equals :data:`TESTED_CONNECTOR_SURFACE` (a test
  proves it), so every finding is a difference of the target.
* A finding ``breaks`` exactly when the connector would not import or instantiate, or an
  override kvpersist or LMCache relies on would be called wrongly or never; ``degrades`` when
  it runs with less; ``info`` otherwise.
* kvpersist's own connector is read from its source file, never imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Literal

from .parsing import _class_members, _decorators, _method_kind, _params, _parse_module
from .resolve import SourceTrees, _Def
from .sources import KVPERSIST_ROOT

Severity = Literal["breaks", "degrades", "info"]

_KV_CONNECTOR = KVPERSIST_ROOT / "serving" / "connector" / "kv_connector.py"
_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
_LMCACHE_CONNECTOR = ("lmcache.integration.vllm.lmcache_mp_connector", "LMCacheMPConnector")

#: The connector API of the tested vLLM (0.32.0): per base class, each public method (and
#: ``__init__``) as (kind, abstract, parameter names).  Kinds: method, classmethod,
#: staticmethod, property.  Parameters: ``*name``/``**name`` for variadic ones and ``*`` before
#: keyword-only ones.  Recorded once with :func:`connector_surface`; a test proves the installed
#: 0.32.0 still gives exactly this.
TESTED_CONNECTOR_SURFACE: dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]] = {
    "KVConnectorBase_V1": {
        "__init__": ("method", False, ("self", "vllm_config", "role", "kv_cache_config")),
        "bind_connector_metadata": ("method", False, ("self", "connector_metadata")),
        "bind_gpu_block_pool": ("method", False, ("self", "gpu_block_pool")),
        "bind_kv_cache_manager": ("method", False, ("self", "kv_cache_manager")),
        "build_connector_meta": ("method", True, ("self", "scheduler_output")),
        "build_connector_worker_meta": ("method", False, ("self",)),
        "build_kv_connector_stats": ("classmethod", False, ("cls", "data")),
        "build_prom_metrics": ("classmethod", False, ("cls", "vllm_config", "metric_types",
                                                      "labelnames", "per_engine_labelvalues")),
        "clear_connector_metadata": ("method", False, ("self",)),
        "finish_forward": ("method", False, ("self",)),
        "get_block_ids_with_load_errors": ("method", False, ("self",)),
        "get_external_cache_hit_sources": ("method", False, ("self", "request",
                                                             "num_external_tokens")),
        "get_finished": ("method", False, ("self", "finished_req_ids")),
        "get_finished_count": ("method", False, ("self",)),
        "get_handshake_metadata": ("method", False, ("self",)),
        "get_kv_connector_kv_cache_events": ("method", False, ("self",)),
        "get_kv_connector_stats": ("method", False, ("self",)),
        "get_loaded_kv_cache_group_ids": ("method", False, ("self", "request")),
        "get_mem_pool_context": ("method", False, ("self",)),
        "get_num_new_matched_tokens": ("method", True, ("self", "request", "num_computed_tokens")),
        "get_required_kvcache_layout": ("classmethod", False, ("cls", "vllm_config")),
        "get_transfer_results": ("method", False, ("self", "finished_req_ids")),
        "handle_preemptions": ("method", False, ("self", "kv_connector_metadata")),
        "has_connector_metadata": ("method", False, ("self",)),
        "has_pending_block_frees": ("method", False, ("self",)),
        "has_pending_push_work": ("method", False, ("self",)),
        "on_new_request": ("method", False, ("self", "request")),
        "register_finished_partial_tail": ("method", False, ("self", "request", "block_ids",
                                                             "partial_tail_offloads")),
        "register_kv_caches": ("method", False, ("self", "kv_caches")),
        "request_finished": ("method", False, ("self", "request", "block_ids")),
        "requires_kv_delivery": ("property", False, ("self",)),
        "requires_piecewise_for_cudagraph": ("classmethod", False, ("cls", "extra_config")),
        "reset_cache": ("method", False, ("self",)),
        "reset_capture_state": ("method", False, ("self",)),
        "role": ("property", False, ("self",)),
        "save_kv_layer": ("method", True, ("self", "layer_name", "kv_layer", "attn_metadata",
                                           "**kwargs")),
        "set_host_xfer_buffer_ops": ("method", False, ("self", "copy_operation")),
        "set_xfer_handshake_metadata": ("method", False, ("self", "metadata")),
        "set_xfer_handshake_metadata_pp_aware": ("method", False, ("self", "metadata")),
        "shutdown": ("method", False, ("self",)),
        "start_load_kv": ("method", True, ("self", "forward_context", "**kwargs")),
        "supports_divergent_local_hybrid_hits": ("property", False, ("self",)),
        "take_events": ("method", False, ("self",)),
        "update_connector_output": ("method", False, ("self", "connector_output")),
        "update_state_after_alloc": ("method", True, ("self", "request", "blocks",
                                                      "num_external_tokens")),
        "wait_for_layer_load": ("method", True, ("self", "layer_name")),
        "wait_for_save": ("method", True, ("self",)),
    },
    "SupportsHMA": {
        "request_finished_all_groups": ("method", True, ("self", "request", "block_ids")),
    },
}


@dataclass(frozen=True)
class ApiFinding:
    """One difference of the connector's API.  ``severity``: ``breaks`` (the connector would
    not import or instantiate, or an override kvpersist or LMCache relies on would be called
    wrongly or never), ``degrades`` (it runs, with less), ``info`` (no effect on serving)."""

    kind: str
    name: str
    severity: Severity
    detail: str


def connector_surface(trees: SourceTrees) -> dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]]:
    """vLLM's connector base classes as :data:`TESTED_CONNECTOR_SURFACE` records them."""
    out: dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]] = {}
    for name in _BASE_CLASSES:
        cls = trees.find(_BASE_MODULE, name)
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            continue
        methods: dict[str, tuple[str, bool, tuple[str, ...]]] = {}
        for member, node in _class_members(cls.node).items():
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (
                    member.startswith("_") and member != "__init__"):
                continue
            abstract = any(d.rpartition(".")[2] == "abstractmethod" for d in _decorators(node))
            methods[member] = (_method_kind(node), abstract, _params(node.args))
        out[name] = dict(sorted(methods.items()))
    return out


def _defined(cls: _Def | None) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The methods class ``cls`` defines itself."""
    if cls is None or not isinstance(cls.node, ast.ClassDef):
        return {}
    return {n: s for n, s in _class_members(cls.node).items()
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}


def _accepts(node: ast.FunctionDef | ast.AsyncFunctionDef, params: tuple[str, ...]) -> bool:
    """Whether an override takes the same parameters (or forwards ``*args, **kwargs``)."""
    own = _params(node.args)
    if any(p.startswith("*") and p != "*" and not p.startswith("**") for p in own) and any(
            p.startswith("**") for p in own):
        return True
    return own[1:] == params[1:]


def _kv_connector_classes() -> tuple[dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]],
                                     set[str]]:
    """kvpersist's connector classes (their own methods) and ``_OWN`` of kv_connector.py."""
    module = _parse_module("kvpersist.serving.connector.kv_connector",
                           _KV_CONNECTOR.relative_to(KVPERSIST_ROOT.parent).as_posix(), False,
                           _KV_CONNECTOR.read_bytes())
    classes: dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    own: set[str] = set()
    for name, binding in module.bindings.items():
        if binding.kind == "class":
            classes[name] = _defined(_Def(module, binding.node))
        elif name == "_OWN" and isinstance(binding.node, ast.Assign) and isinstance(
                binding.node.value, ast.Set):
            own = {e.value for e in binding.node.value.elts if isinstance(e, ast.Constant)
                   and isinstance(e.value, str)}
    return classes, own


def _check_surface(trees: SourceTrees) -> list[ApiFinding]:
    target = connector_surface(trees)
    out: list[ApiFinding] = []
    if not target.get("KVConnectorBase_V1"):
        return [ApiFinding("base-class", f"{_BASE_MODULE}.KVConnectorBase_V1", "breaks",
                           "vLLM's connector base class is not in the target")]
    classes, own_names = _kv_connector_classes()
    kvp = classes.get("KvPersistConnector", {})
    disabled = classes.get("DisabledKvConnector", {})
    overriders = {
        "kvpersist's KvPersistConnector": kvp,
        "kvpersist's DisabledKvConnector": disabled,
        "kvpersist's NamespacedLMCacheConnector": classes.get("NamespacedLMCacheConnector", {}),
        "LMCache's LMCacheMPConnector": _defined(trees.find(*_LMCACHE_CONNECTOR)),
    }
    lmcache_defines = overriders["LMCache's LMCacheMPConnector"]
    for base in _BASE_CLASSES:
        tested, now = TESTED_CONNECTOR_SURFACE.get(base, {}), target.get(base, {})
        if not now:
            out.append(ApiFinding("base-class", f"{_BASE_MODULE}.{base}", "breaks",
                                  "the class is not in the target"))
            continue
        for name in sorted(set(tested) | set(now)):
            qual = f"{base}.{name}"
            old, new = tested.get(name), now.get(name)
            if new is None:
                assert old is not None
                users = [who for who, defs in overriders.items() if name in defs]
                # kvpersist's own logic (the handshake, the scheduler side) would never run;
                # LMCache's override not either; DisabledKvConnector's no-op does not matter
                relied = name in own_names or any(
                    name in overriders[who] for who in ("kvpersist's KvPersistConnector",
                                                        "kvpersist's NamespacedLMCacheConnector"))
                severity: Severity = "breaks" if relied else "degrades" if name in \
                    lmcache_defines else "info"
                out.append(ApiFinding(
                    "removed", qual, severity,
                    "vLLM no longer calls it" + (f"; overridden by {', '.join(users)}, "
                                                 "which is then never called" if users else "")))
                continue
            if old is None:
                out.append(_added(qual, name, new, kvp, own_names, overriders, lmcache_defines))
                continue
            if new[1] and not old[1]:
                lacking = [who for who in ("kvpersist's DisabledKvConnector",
                                           "LMCache's LMCacheMPConnector")
                           if name not in overriders[who]]
                out.append(ApiFinding(
                    "abstract-added", qual, "breaks" if lacking else "info",
                    "now abstract" + (f"; not implemented by {', '.join(lacking)}: it cannot "
                                      "be instantiated" if lacking else "")))
            elif old[1] and not new[1]:
                out.append(ApiFinding("abstract-removed", qual, "info",
                                      "no longer abstract (a default implementation exists)"))
            if old[0] != new[0]:
                out.append(ApiFinding("kind-changed", qual, "breaks" if any(
                    name in d for d in overriders.values()) else "info",
                    f"was a {old[0]}, now a {new[0]}"))
            if old[2] != new[2]:
                wrong = [who for who, defs in overriders.items()
                         if name in defs and not _accepts(defs[name], new[2])]
                right = [who for who, defs in overriders.items()
                         if name in defs and who not in wrong]
                detail = (f"parameters ({', '.join(old[2])}) -> ({', '.join(new[2])})")
                if wrong:
                    detail += f"; overridden with other parameters by {', '.join(wrong)}"
                if right:
                    detail += f"; taken as before by {', '.join(right)}"
                if name not in kvp and name not in own_names and new[0] in ("method",
                                                                             "property"):
                    detail += "; KvPersistConnector forwards it with *args, **kwargs"
                out.append(ApiFinding("params-changed", qual, "breaks" if wrong else "info",
                                      detail))
    return out


def _added(qual: str, name: str, new: tuple[str, bool, tuple[str, ...]],
           kvp: dict[str, Any], own_names: set[str],
           overriders: dict[str, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]],
           lmcache_defines: dict[str, Any]) -> ApiFinding:
    """A method the tested vLLM's base class did not have."""
    kind, abstract, params = new
    sig = f"{kind} ({', '.join(params)})"
    lmc = name in lmcache_defines
    lacking = [who for who in ("kvpersist's DisabledKvConnector", "LMCache's LMCacheMPConnector")
               if name not in overriders[who]]
    if abstract and lacking:
        return ApiFinding("added", qual, "breaks",
                          f"new abstract {sig}; not implemented by {', '.join(lacking)}: it "
                          "cannot be instantiated")
    if kind in ("classmethod", "staticmethod"):
        if name in kvp:
            return ApiFinding("added", qual, "info", f"new {sig}; KvPersistConnector defines it")
        if lmc:
            return ApiFinding("added", qual, "degrades",
                              f"new {sig}, not forwarded (class-level API): vLLM gets the base "
                              "default, not LMCacheMPConnector's override")
        return ApiFinding("added", qual, "info",
                          f"new {sig}, not forwarded (class-level API); LMCache does not "
                          "override it either, so the base default applies as with LMCache")
    if name in kvp or name in own_names:
        return ApiFinding("added", qual, "info", f"new {sig}; KvPersistConnector defines it")
    return ApiFinding("added", qual, "info",
                      f"new {sig}; forwarded to the inner connector automatically, where "
                      + ("LMCacheMPConnector overrides it" if lmc else
                         "the base default runs (LMCacheMPConnector does not override it)"))
