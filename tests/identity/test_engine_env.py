"""vLLM's environment variables and LMCache's connector options are classified, closed-world,
against the installed sources; a closing one turns the gate off by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpersist.identity.engine_env import (
    CLOSING_ENV,
    EXTRA_CONFIG,
    NEUTRAL_ENV,
    closing_env_reasons,
    closing_extra_config_reasons,
)


def test_every_vllm_environment_variable_is_classified_and_every_entry_exists() -> None:
    import vllm.envs

    installed = set(vllm.envs.environment_variables)
    classified = set(NEUTRAL_ENV) | set(CLOSING_ENV)
    assert not set(NEUTRAL_ENV) & set(CLOSING_ENV)
    assert sorted(installed - classified) == []  # a new variable: classify it
    assert sorted(classified - installed) == []  # a variable vLLM no longer has


def lmcache_option_names() -> set[str]:
    """Every ``lmcache.*`` key LMCache's MP connector reads from ``kv_connector_extra_config``:
    the literals it passes to ``get_from_extra_config`` and its adapter's ``ExtraConfigDefault``
    members (read under the ``lmcache.mp.`` prefix)."""
    from lmcache.integration.vllm import lmcache_mp_connector, vllm_multi_process_adapter

    source = Path(lmcache_mp_connector.__file__).read_text()
    names = set(re.findall(r'get_from_extra_config\(\s*"(lmcache\.[a-z_.]+)"', source))
    names |= {"lmcache.mp." + member.name
              for member in vllm_multi_process_adapter.ExtraConfigDefault}
    return names


def test_every_lmcache_connector_option_is_classified() -> None:
    read = lmcache_option_names()
    assert len(read) >= 10  # the parse found LMCache's options at all
    assert sorted(read - set(EXTRA_CONFIG)) == []


def test_a_closing_variable_names_itself_and_a_neutral_one_is_silent() -> None:
    assert closing_env_reasons({"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_CPU_KVCACHE_SPACE": "4"}) == []
    (reason,) = closing_env_reasons({"VLLM_KV_CACHE_LAYOUT": "HND"})
    assert "VLLM_KV_CACHE_LAYOUT" in reason and "layout" in reason


@pytest.mark.parametrize(("extra", "closes"), [
    ({"lmcache.mp.mq_timeout": 15, "kvpersist.pins": "x"}, False),
    ({"lmcache.mp.autostart": False}, False),
    ({"lmcache.mp.autostart": True}, True),
    ({"lmcache.mp.transfer_intermediate_tensors": True}, True),
    ({"lmcache.mp.some_new_option": 1}, True),
])
def test_lmcache_options_close_the_gate_only_when_unkeyable(extra: dict[str, object],
                                                            closes: bool) -> None:
    assert bool(closing_extra_config_reasons(extra)) is closes


def test_a_closing_variable_at_its_default_changes_nothing() -> None:
    assert closing_env_reasons({"VLLM_MLA_DISABLE": "0", "VLLM_CPU_INT4_W4A8": "1",
                                "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}) == []
    assert len(closing_env_reasons({"VLLM_MLA_DISABLE": "1",
                                    "VLLM_FLOAT32_MATMUL_PRECISION": "medium"})) == 2
