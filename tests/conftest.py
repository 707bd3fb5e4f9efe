"""Shared test settings: the ``unit`` fixture (see :mod:`tests.utils`), and a state home of the
session's own.

Every ``somatize-worker --id`` a test starts keeps its identity key under
``$XDG_STATE_HOME/somatize`` unless told otherwise: the session points that at a temporary
directory, so that no test writes into the home of whoever runs it.

Each test process, and every process it starts, runs one maths thread (``OMP_NUM_THREADS``,
set before torch is first imported; a test or a worker's ``--threads`` may still ask for more):
the suite runs more processes than there are cores, and OpenMP's idle threads spin while they
wait for work, which took a fifth of the in-process tests' CPU on two cores.

The files that start real processes run first: ``make test`` hands whole files to two test
processes, and a long file handed out last would leave one of them idle while the other finishes
it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before tests.utils imports torch

from tests import zygote
from tests.utils import shared_fork_servers, timeout_unit

_TESTS = Path(__file__).parent
_STATE_HOME = tempfile.TemporaryDirectory(prefix="somatize-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE_HOME.name
shared_fork_servers()  # made here, before pytest -n starts its test processes, which inherit it
zygote.start()  # the same: one for the run (tests.zygote)


def _weight(item: pytest.Item) -> int:
    """0 for the files that start clusters (the longest), 1 for the benchmarks' checks and the
    worker's tests (which start agents and daemons: ``test_supervisor`` alone takes a minute,
    and handed out last it held one test process for that minute while the other idled), 2
    for the rest."""
    first = item.path.relative_to(_TESTS).parts[0]
    return {"integration": 0, "benchmarks": 1, "worker": 1}.get(first, 2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The process-starting files first, each file's tests in their own order."""
    items.sort(key=_weight)


@pytest.fixture
def unit() -> float:
    """One unit of test time, in seconds (see :func:`tests.utils.timeout_unit`)."""
    return timeout_unit()
