"""The benchmarks' parsing of server-setting variants (``KEY=VALUE[,KEY=VALUE]``)."""

from __future__ import annotations

import pytest

from kvpersist.testing.helpers import setting_overrides


def test_a_variant_is_each_key_with_its_value_and_a_value_may_hold_an_equals_sign() -> None:
    assert setting_overrides("KVP_CPU_DIRECT_COPY=false") == {"KVP_CPU_DIRECT_COPY": "false"}
    assert setting_overrides("A=1,B=x=y,C=") == {"A": "1", "B": "x=y", "C": ""}


@pytest.mark.parametrize("spec", ["KVP_CPU_DIRECT_COPY", "A=1,B", "=1", "A=1,,B=2"])
def test_an_item_without_a_key_and_an_equals_sign_is_named_in_the_error(spec: str) -> None:
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        setting_overrides(spec)
