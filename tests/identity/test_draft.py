"""``draft_sha256`` from an engine's speculative config (the real vLLM config is in
tests/serving/test_connector_gate.py): none without a draft model, absent when unreadable."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvpersist.identity.draft import draft_digest
from kvpersist.identity.fields import NO_DRAFT
from kvpersist.identity.weights_digest import FileDigestCache


def test_no_speculative_config_or_a_draft_free_proposer_is_none(tmp_path: Path) -> None:
    cache = FileDigestCache(tmp_path)
    assert draft_digest(SimpleNamespace(speculative_config=None), cache) == NO_DRAFT
    for method in ("ngram", "ngram_gpu", "suffix"):
        spec = SimpleNamespace(method=method, draft_model_config=None)
        assert draft_digest(SimpleNamespace(speculative_config=spec), cache) == NO_DRAFT


def test_a_draft_method_without_a_readable_draft_has_no_digest(tmp_path: Path) -> None:
    """Left out, the field is missing and the gate keeps caching off."""
    cache = FileDigestCache(tmp_path)
    no_model = SimpleNamespace(method="eagle", draft_model_config=None)
    assert draft_digest(SimpleNamespace(speculative_config=no_model), cache) is None
    gone = SimpleNamespace(model=str(tmp_path / "no-such-draft"), hf_overrides=None,
                           config_format="auto", revision=None)
    spec = SimpleNamespace(method="eagle", draft_model_config=gone)
    assert draft_digest(SimpleNamespace(speculative_config=spec), cache) is None
