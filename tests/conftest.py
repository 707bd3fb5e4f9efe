"""Shared test settings: the ``unit`` fixture (see :mod:`tests.utils`)."""

from __future__ import annotations

import pytest

from tests.utils import timeout_unit


@pytest.fixture
def unit() -> float:
    """One unit of test time, in seconds (see :func:`tests.utils.timeout_unit`)."""
    return timeout_unit()
