"""Identity: refusals name the field; any single change moves the namespace; formatting does not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvpersist.identity import (
    FIELDS,
    NAMESPACE_RE,
    CacheIdentity,
    IdentityError,
    diff_identities,
    format_pins,
    merge_sources,
    parse_pins_text,
)
from kvpersist.identity.fields import OPTIONAL_FIELDS
from kvpersist.identity.sources import (
    chat_template_digest,
    from_model_folder,
    hf_snapshot_origin,
    resolved_kv_cache_dtype,
)

BASE: dict[str, object] = {
    "model_id": "org/model",
    "model_revision": "0123456789abcdef0123456789abcdef01234567",
    "tokenizer_id": "org/model",
    "tokenizer_revision": "0123456789abcdef0123456789abcdef01234567",
    "kv_cache_dtype": "bfloat16",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 128,
    "num_layers": 32,
    "tensor_parallel_size": 4,
    "pipeline_parallel_size": 1,
    "connector": "LMCacheMPConnector",
    "build": "kvpersist-format=1;lmcache=0.5.6;vllm=0.32.0",
    "max_model_len": 32768,
    "chat_template_sha256": "a" * 64,
    "model_dtype": "bfloat16",
    "quantization": "none",
    "model_config_sha256": "c" * 64,
    "weights_sha256": "e" * 64,
    "mm_processor_kwargs_sha256": "none",
    "draft_sha256": "none",
}

#: A different valid value for every field.
CHANGED: dict[str, object] = {
    "model_id": "org/other",
    "model_revision": "f" * 40,
    "tokenizer_id": "org/tok",
    "tokenizer_revision": "e" * 40,
    "kv_cache_dtype": "float16",
    "block_size": 32,
    "num_kv_heads": 4,
    "head_size": 64,
    "num_layers": 31,
    "tensor_parallel_size": 8,
    "pipeline_parallel_size": 2,
    "connector": "OtherConnector",
    "build": "kvpersist-format=1;lmcache=0.5.7;vllm=0.32.0",
    "max_model_len": 32767,
    "chat_template_sha256": "b" * 64,
    "model_dtype": "float16",
    "quantization": "fp8",
    "model_config_sha256": "d" * 64,
    "weights_sha256": "f" * 64,
    "mm_processor_kwargs_sha256": "9" * 64,
    "draft_sha256": "8" * 64,
}


def test_every_field_has_a_changed_value() -> None:
    assert set(CHANGED) == set(BASE) == {f.name for f in FIELDS}


def test_namespace_form_and_model_name() -> None:
    ident = CacheIdentity.from_mapping(BASE)
    assert NAMESPACE_RE.match(ident.namespace)
    assert ident.lmcache_model_name() == f"org/model/{ident.namespace}"
    from kvpersist.l2.layout import sanitize_model_name

    assert sanitize_model_name(ident.lmcache_model_name()) == f"org--model--{ident.namespace}"


def test_canonical_json_is_sorted_compact_ascii() -> None:
    ident = CacheIdentity.from_mapping(BASE)
    text = ident.canonical_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert text.isascii() and " " not in text


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_any_single_field_change_changes_namespace(name: str) -> None:
    base = CacheIdentity.from_mapping(BASE).namespace
    changed = CacheIdentity.from_mapping({**BASE, name: CHANGED[name]}).namespace
    assert changed != base


def test_a_field_added_later_keeps_every_earlier_namespace_at_its_earlier_value() -> None:
    """An identity (or record) without ``mm_processor_kwargs_sha256`` is the one with 'none':
    same canonical JSON, hence the namespace it had before the field existed."""
    earlier = {k: v for k, v in BASE.items() if k not in OPTIONAL_FIELDS}
    before = CacheIdentity.from_mapping(earlier)
    assert before == CacheIdentity.from_mapping(BASE)
    assert "mm_processor_kwargs_sha256" not in before.canonical_json()
    assert "draft_sha256" not in before.canonical_json()
    assert before.namespace == "kvp-" + hashlib.sha256(
        json.dumps(earlier, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    given = CacheIdentity.from_mapping({**BASE, "mm_processor_kwargs_sha256": "9" * 64})
    assert given.as_dict()["mm_processor_kwargs_sha256"] == "9" * 64
    assert CacheIdentity.from_mapping(given.as_dict()) == given


def test_order_and_formatting_do_not_change_namespace() -> None:
    base = CacheIdentity.from_mapping(BASE).namespace
    reformatted = {
        **BASE,
        "model_revision": str(BASE["model_revision"]).upper(),
        "kv_cache_dtype": "torch.bfloat16",
        "block_size": " 16 ",
        "head_size": "128",
        "chat_template_sha256": "A" * 64,
        "model_id": "  org/model ",
    }
    reordered = dict(reversed(list(reformatted.items())))
    assert CacheIdentity.from_mapping(reordered).namespace == base
    assert CacheIdentity.from_mapping({**BASE, "kv_cache_dtype": "bf16"}).namespace == base


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("kv_cache_dtype", "auto", "'auto' is not a resolved dtype"),
        ("kv_cache_dtype", "float13", "unknown KV-cache dtype"),
        ("model_revision", "main", "full 40-hex commit SHA"),
        ("model_revision", "abc123", "full 40-hex commit SHA"),
        ("tokenizer_revision", "v1.0", "full 40-hex commit SHA"),
        ("model_id", "", "is empty"),
        ("model_id", "   ", "is empty"),
        ("model_id", "org/model@x", "must not contain '@'"),
        ("block_size", "0", "positive integer"),
        ("block_size", "sixteen", "positive integer"),
        ("tensor_parallel_size", -1, "positive integer"),
        ("chat_template_sha256", "abc", "64 hex digits"),
        ("build", None, "is missing"),
    ],
)
def test_refusals_name_the_field(name: str, value: object, fragment: str) -> None:
    with pytest.raises(IdentityError) as info:
        CacheIdentity.from_mapping({**BASE, name: value})
    assert info.value.field == name
    assert fragment in str(info.value)
    assert name in str(info.value)


def test_missing_field_is_refused() -> None:
    partial = {k: v for k, v in BASE.items() if k != "head_size"}
    with pytest.raises(IdentityError, match="head_size"):
        CacheIdentity.from_mapping(partial)


def test_unknown_field_is_refused() -> None:
    with pytest.raises(IdentityError, match="not an identity field"):
        CacheIdentity.from_mapping({**BASE, "colour": "blue"})


def test_pins_round_trip_and_errors() -> None:
    ident = CacheIdentity.from_mapping(BASE)
    parsed = parse_pins_text(format_pins(ident))
    assert CacheIdentity.from_mapping(parsed) == ident
    text = 'export KVP_MODEL_ID="org/model"\n# comment\n\nKVP_BLOCK_SIZE=16\n'
    assert parse_pins_text(text) == {"model_id": "org/model", "block_size": "16"}
    with pytest.raises(IdentityError, match="unknown key 'KVP_BLOK_SIZE'"):
        parse_pins_text("KVP_BLOK_SIZE=16\n")
    with pytest.raises(IdentityError, match="expected KEY=value"):
        parse_pins_text("KVP_BLOCK_SIZE\n")
    with pytest.raises(IdentityError, match="pinned twice"):
        parse_pins_text("KVP_BLOCK_SIZE=16\nKVP_BLOCK_SIZE=32\n")


def test_merge_agreeing_sources_enables_caching() -> None:
    pins = {k: str(v) for k, v in BASE.items()}
    live = {"block_size": 16, "kv_cache_dtype": "torch.bfloat16", "num_kv_heads": 8}
    res = merge_sources(pins, live)
    assert res.enabled and res.identity == CacheIdentity.from_mapping(BASE)
    assert res.sources["block_size"] == "both"
    assert res.sources["model_id"] == "pin"


def test_merge_disagreement_turns_caching_off_and_names_field() -> None:
    pins = {k: str(v) for k, v in BASE.items()}
    res = merge_sources(pins, {"block_size": 32})
    assert not res.enabled and res.identity is None
    assert any("block_size" in p and "pinned 16" in p and "32" in p for p in res.problems)
    assert "caching OFF" in res.summary()


def test_merge_missing_field_turns_caching_off() -> None:
    pins = {k: str(v) for k, v in BASE.items() if k != "max_model_len"}
    res = merge_sources(pins, {})
    assert not res.enabled
    assert any("max_model_len" in p and "KVP_MAX_MODEL_LEN" in p for p in res.problems)


def test_merge_bad_live_value_turns_caching_off() -> None:
    pins = {k: str(v) for k, v in BASE.items() if k != "kv_cache_dtype"}
    res = merge_sources(pins, {"kv_cache_dtype": "auto"})
    assert not res.enabled
    assert any("kv_cache_dtype" in p for p in res.problems)


def test_diff_identities_names_only_real_differences() -> None:
    other = {**BASE, "block_size": "16", "tensor_parallel_size": 8}
    diffs = diff_identities(BASE, other)
    assert [d[0] for d in diffs] == ["tensor_parallel_size"]


def test_hf_snapshot_origin(tmp_path: Path) -> None:
    sha = "c" * 40
    snap = tmp_path / "models--org--name" / "snapshots" / sha
    snap.mkdir(parents=True)
    assert hf_snapshot_origin(snap) == ("org/name", sha)
    assert hf_snapshot_origin(tmp_path) is None
    not_sha = tmp_path / "models--org--name" / "snapshots" / "main"
    not_sha.mkdir()
    assert hf_snapshot_origin(not_sha) is None


def test_from_model_folder_reads_geometry_and_template(tmp_path: Path) -> None:
    sha = "d" * 40
    snap = tmp_path / "models--org--name" / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({
        "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    }))
    (snap / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    got = from_model_folder(snap)
    assert got["num_kv_heads"] == 2 and got["head_size"] == 32 and got["num_layers"] == 3
    assert got["max_model_len"] == 4096 and got["kv_cache_dtype"] == "bfloat16"
    assert got["model_id"] == "org/name" and got["model_revision"] == sha
    assert got["tokenizer_id"] == "org/name"
    assert got["chat_template_sha256"] == chat_template_digest("{{ x }}")
    # An explicit KV dtype wins over the weights' dtype; a jinja file wins over the json.
    (snap / "chat_template.jinja").write_text("{{ y }}")
    got = from_model_folder(snap, kv_cache_dtype="fp8")
    assert got["kv_cache_dtype"] == "fp8"
    assert got["chat_template_sha256"] == chat_template_digest("{{ y }}")


def test_from_model_folder_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        from_model_folder(tmp_path)


def test_one_kv_cache_dtype_rule() -> None:
    """vLLM's: ``auto`` (or nothing) is the model's dtype; an explicit one wins; unknown stays
    unknown (the identity then lacks the field)."""
    assert resolved_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolved_kv_cache_dtype(None, "float32") == "float32"
    assert resolved_kv_cache_dtype("fp8_e4m3", "bfloat16") == "fp8_e4m3"
    assert resolved_kv_cache_dtype("auto", None) is None
    assert resolved_kv_cache_dtype("auto", "auto") is None
