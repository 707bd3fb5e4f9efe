"""Shared test settings: the ``unit`` fixture (see :mod:`tests.utils`), and a state home of the
session's own.

Every ``somatize-worker --id`` a test starts keeps its identity key under
``$XDG_STATE_HOME/somatize`` unless told otherwise: the session points that at a temporary
directory, so that no test writes into the home of whoever runs it.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.utils import timeout_unit

_STATE_HOME = tempfile.TemporaryDirectory(prefix="somatize-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE_HOME.name


@pytest.fixture
def unit() -> float:
    """One unit of test time, in seconds (see :func:`tests.utils.timeout_unit`)."""
    return timeout_unit()
