"""The two network-namespace hosts the multi-host tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.e2e.test_multihost import Host, namespace_hosts


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    with namespace_hosts() as pair:
        yield pair
