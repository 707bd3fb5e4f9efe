"""Shared test settings.

Every timeout in the tests is a multiple of one unit, scaled by ``SOMATIZE_TEST_TIMEOUT_SCALE``
(default 1) so a slow machine stretches them all at once instead of a test growing bare sleeps.
"""

from __future__ import annotations

import os

import pytest


def timeout_unit() -> float:
    """One unit of test time, in seconds."""
    return float(os.environ.get("SOMATIZE_TEST_TIMEOUT_SCALE", "1"))


@pytest.fixture
def unit() -> float:
    """One unit of test time, in seconds (see :func:`timeout_unit`)."""
    return timeout_unit()
