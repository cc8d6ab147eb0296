"""The benchmarks' parsing of setting variants (``KEY=VALUE[,KEY=VALUE]``) and their split
between the cache server and vLLM."""

from __future__ import annotations

import argparse

import pytest

from kvpersist.testing.helpers import server_settings_in, setting_overrides


def test_a_variant_is_each_key_with_its_value_and_a_value_may_hold_an_equals_sign() -> None:
    assert setting_overrides("KVP_CPU_DIRECT_COPY=false") == {"KVP_CPU_DIRECT_COPY": "false"}
    assert setting_overrides("A=1,B=x=y,C=") == {"A": "1", "B": "x=y", "C": ""}


@pytest.mark.parametrize("spec", ["KVP_CPU_DIRECT_COPY", "A=1,B", "=1", "A=1,,B=2"])
def test_an_item_without_a_key_and_an_equals_sign_is_named_in_the_error(spec: str) -> None:
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        setting_overrides(spec)


def test_as_an_argparse_type_the_bad_item_is_named_in_the_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", type=setting_overrides, action="append", default=[])
    assert parser.parse_args(["--variant", "A=1,B=2"]).variant == [{"A": "1", "B": "2"}]
    with pytest.raises(SystemExit):
        parser.parse_args(["--variant", "A=1,B"])
    assert "'B' is not KEY=VALUE (in 'A=1,B')" in capsys.readouterr().err


def test_only_the_servers_own_settings_go_to_the_server() -> None:
    variant = {"KVP_L2_DIRECT_IO": "false", "PYTHONPATH": "/x", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert server_settings_in(variant) == {"KVP_L2_DIRECT_IO": "false"}


def test_a_kvp_name_that_is_no_setting_is_refused_when_parsed_and_never_left_out() -> None:
    with pytest.raises(ValueError, match=r"unknown setting.*KVP_L2_DIRECT_OI"):
        setting_overrides("KVP_L2_DIRECT_IO=true,KVP_L2_DIRECT_OI=false")
    with pytest.raises(ValueError, match=r"unknown setting.*KVP_L2_DIRECT_OI"):
        server_settings_in({"KVP_L2_DIRECT_OI": "false"})
