"""The one place that decides which L2 adapter the LMCache server gets, and how.

Invariants
----------
* kvpersist's own adapter is configured by :class:`KvPersistAdapterParams`, typed and derived
  from validated :class:`~kvpersist.config.server.ServerSettings` only.  LMCache's adapters,
  kept for the GDS/Weka profile and for benchmarks against the peers, are templates in
  ``l2-adapters.json`` (package data) whose ``${VAR}`` placeholders are filled from the same
  settings; neither ever carries an unvalidated value.
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

import dataclasses
import json
import re
from dataclasses import dataclass
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


#: The ``KVP_L2_ADAPTER`` name of kvpersist's own adapter (the default).
KVPERSIST = "kvpersist"


@dataclass(frozen=True)
class KvPersistAdapterParams:
    """The ``adapter_params`` of kvpersist's adapter (read back by
    ``kvpersist.l2.adapter.KvPersistL2AdapterConfig.from_dict``).  ``path`` is this node's part
    on a shared tree, ``max_capacity_gb`` this node's share of the budget."""

    path: str
    max_capacity_gb: float
    sharded: bool
    walker: str
    walk_threads: int
    direct_io: bool
    scan_snapshot: bool
    fsync: bool
    io_threads: int
    file_threads: int
    quarantine_max_files: int
    shared_tree: str | None = None
    extra_paths: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> KvPersistAdapterParams:
        return cls(path=str(settings.cache_root), max_capacity_gb=settings.node_budget_gb,
                   sharded=settings.l2_sharded, walker=settings.walker,
                   walk_threads=settings.walk_threads, direct_io=settings.l2_direct_io,
                   scan_snapshot=settings.scan_snapshot, fsync=settings.l2_fsync,
                   io_threads=settings.l2_io_threads, file_threads=settings.l2_file_threads,
                   quarantine_max_files=settings.l2_quarantine_max_files,
                   shared_tree=str(settings.tree) if settings.shared else None,
                   extra_paths=tuple(str(p) for p in settings.extra_roots))

    def as_dict(self) -> dict[str, Any]:
        """The JSON object (None and an empty ``extra_paths`` left out)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.extra_paths:
            out["extra_paths"] = list(self.extra_paths)
        else:
            out.pop("extra_paths")
        return out


def kvpersist_adapter_config(settings: ServerSettings) -> dict[str, Any]:
    """LMCache's plugin-adapter config of kvpersist's adapter, with LMCache's LRU eviction at the
    settings' watermark; data kept on shutdown."""
    return {
        "type": "plugin",
        "module_path": "kvpersist.l2.adapter",
        "class_name": "KvPersistL2Adapter",
        "config_class_name": "KvPersistL2AdapterConfig",
        "adapter_params": KvPersistAdapterParams.from_settings(settings).as_dict(),
        "persist_enabled": True,
        "eviction": {"eviction_policy": "LRU",
                     "trigger_watermark": settings.eviction_watermark,
                     "eviction_ratio": settings.eviction_ratio},
    }


def known_adapters() -> list[str]:
    return sorted([KVPERSIST, *_templates()])


def _numeric_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _substitutions(settings: ServerSettings) -> dict[str, str]:
    return {
        "KVP_CACHE_ROOT": str(settings.cache_root),
        "KVP_CACHE_BUDGET_GB": _numeric_text(settings.node_budget_gb),
        "KVP_EVICTION_WATERMARK": _numeric_text(settings.eviction_watermark),
        "KVP_EVICTION_RATIO": _numeric_text(settings.eviction_ratio),
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
    if settings.l2_adapter == KVPERSIST:
        config = kvpersist_adapter_config(settings)
    else:
        templates = _templates()
        if settings.l2_adapter not in templates:
            raise SettingsError(f"no L2 adapter template named {settings.l2_adapter!r}")
        config = _fill(templates[settings.l2_adapter], _substitutions(settings))
        if config.get("persist_enabled") is False:
            raise SettingsError(f"adapter {settings.l2_adapter!r} has persist_enabled=false")
        assert isinstance(config, dict)
    if settings.l2_serde is not None:
        config["serde"] = dict(settings.l2_serde)
        if config["serde"].get("type") in AESGCM_ALIASES:
            config["serde"]["type"] = BOUND_AESGCM
    refuse_lossy_serde(config, f"the {settings.l2_adapter} L2 adapter config")
    return config
