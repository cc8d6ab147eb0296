"""Every L2 test that opens stores through :func:`kvpersist.testing.checked_stores.
open_checked_store` ends on their ``check()`` oracle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpersist.testing.checked_stores import check_and_close, forget_opened


@pytest.fixture(autouse=True)
def every_test_ends_on_a_consistent_store() -> Iterator[None]:
    forget_opened()
    yield
    check_and_close()
