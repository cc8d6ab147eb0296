"""The one place that decides which L2 adapter the LMCache server gets, and how.

Invariants
----------
* Templates live in ``l2-adapters.json`` (package data); ``${VAR}`` placeholders are filled
  from validated :class:`~kvpersist.config.server.ServerSettings` only, so an adapter config never
  carries an unvalidated value.
* Every adapter config produced here keeps data on shutdown (``persist_enabled`` true).
* On a shared tree (``KVP_NODE_ID``) the adapter's ``path`` is this node's part, its capacity
  this node's share of ``KVP_CACHE_BUDGET_GB``, and ``shared_tree`` the tree whose other parts
  it reads.
* Lossless only: a ``serde`` block (LMCache's codecs around an L2 adapter) is accepted only
  when its type is in :data:`LOSSLESS_SERDES`; a lossy codec (fp8, turboquant, ...) would hand
  back KV that differs from what was computed, which is a wrong token, so it is refused
  (:func:`refuse_lossy_serde`), here and again in the server's entry point.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .paths import ADAPTER_TEMPLATES
from .values import SettingsError

if TYPE_CHECKING:
    from .server import ServerSettings

#: kvpersist's AES-GCM serde: each object encrypted and authenticated together with its object
#: key (``kvpersist.l2.bound_aesgcm``): a wrong key, a changed byte or a file renamed to another
#: key is a failed load, a miss.
BOUND_AESGCM = "kvp-aesgcm"
#: Spellings in ``KVP_L2_SERDE`` that mean :data:`BOUND_AESGCM` (LMCache's own ``aesgcm`` does
#: not bind the key, so it is never handed to LMCache).
AESGCM_ALIASES = ("aesgcm",)
#: Serde types that give back exactly the bytes they were given.
LOSSLESS_SERDES = (BOUND_AESGCM,)

_PLACEHOLDER = re.compile(r"\$\{([A-Z0-9_]+)\}")


def _templates(path: Path = ADAPTER_TEMPLATES) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def known_adapters() -> list[str]:
    return sorted(_templates())


def _numeric_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _substitutions(settings: ServerSettings) -> dict[str, str]:
    return {
        "KVP_CACHE_ROOT": str(settings.cache_root),
        "KVP_CACHE_BUDGET_GB": _numeric_text(settings.node_budget_gb),
        "KVP_EVICTION_WATERMARK": _numeric_text(settings.eviction_watermark),
        "KVP_EVICTION_RATIO": _numeric_text(settings.eviction_ratio),
        "KVP_L2_SHARDED": "true" if settings.l2_sharded else "false",
        "KVP_WALKER": settings.walker,
        "KVP_WALK_THREADS": str(settings.walk_threads),
        "KVP_L2_DIRECT_IO": "true" if settings.l2_direct_io else "false",
        "KVP_SCAN_SNAPSHOT": "true" if settings.scan_snapshot else "false",
    }


def _fill(node: Any, subs: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _fill(v, subs) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, subs) for v in node]
    if isinstance(node, str):
        whole = _PLACEHOLDER.fullmatch(node)
        if whole and whole.group(1) in ("KVP_EVICTION_WATERMARK", "KVP_EVICTION_RATIO"):
            return float(subs[whole.group(1)])

        def repl(m: re.Match[str]) -> str:
            if m.group(1) not in subs:
                raise SettingsError(f"l2-adapters.json uses unknown placeholder ${{{m.group(1)}}}")
            return subs[m.group(1)]

        return _PLACEHOLDER.sub(repl, node)
    return node


def refuse_lossy_serde(config: Any, where: str) -> None:
    """Raise :class:`SettingsError` when ``config`` (an adapter config, at any depth) carries a
    ``serde`` block that is not lossless, or one without a type."""
    if isinstance(config, list):
        for item in config:
            refuse_lossy_serde(item, where)
        return
    if not isinstance(config, dict):
        return
    serde = config.get("serde")
    if serde is not None:
        kind = serde.get("type") if isinstance(serde, dict) else None
        if kind not in LOSSLESS_SERDES:
            raise SettingsError(
                f"{where}: serde {kind!r} is refused: kvpersist serves only the exact KV that was "
                "computed (a lossy codec such as fp8 or turboquant changes tokens). Lossless "
                f"serdes: {', '.join(LOSSLESS_SERDES)}; or remove the serde block")
    for key, value in config.items():
        if key != "serde":
            refuse_lossy_serde(value, where)


def l2_adapter_config(settings: ServerSettings) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object for ``settings.l2_adapter``."""
    templates = _templates()
    if settings.l2_adapter not in templates:
        raise SettingsError(f"no L2 adapter template named {settings.l2_adapter!r}")
    config = _fill(templates[settings.l2_adapter], _substitutions(settings))
    if config.get("persist_enabled") is False:
        raise SettingsError(f"adapter {settings.l2_adapter!r} has persist_enabled=false")
    assert isinstance(config, dict)
    if settings.shared:  # this node's part is the path; the tree is where the others are
        config["adapter_params"]["shared_tree"] = str(settings.tree)
    if settings.l2_serde is not None:
        config["serde"] = dict(settings.l2_serde)
        if config["serde"].get("type") in AESGCM_ALIASES:
            config["serde"]["type"] = BOUND_AESGCM
    refuse_lossy_serde(config, f"the {settings.l2_adapter} L2 adapter config")
    return config
