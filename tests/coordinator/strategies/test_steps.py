"""Steps the strategies share, and FedAvg's records of dropped workers."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.errors import WorkerCallError
from coordinator.strategies import JobInputs, StrategyOptionsError
from coordinator.strategies.federated.cohort import Cohort, DroppedWorker, listed, reasons
from coordinator.strategies.steps import plain_prefix
from protocol.errors import ErrorCode, ErrorInfo
from protocol.messages import NodeInfo
from protocol.rules.rows import rows_of


def job(*nodes: tuple[str, bool]) -> JobInputs:
    infos = {n: NodeInfo(differentiable=torch) for n, torch in nodes}
    return JobInputs([n for n, _ in nodes], {}, None, None, infos)


def test_the_plain_prefix_is_the_plain_filters_before_the_first_torch_filter():
    assert plain_prefix(job(("c", False), ("m", True)), "s", "") == (["m"], ["c"])
    with pytest.raises(StrategyOptionsError, match=r"^s fits plain .* \['c'\] come after 'm'"):
        plain_prefix(job(("m", True), ("c", False)), "s", "")
    with pytest.raises(StrategyOptionsError, match=r"has none; use Local$"):
        plain_prefix(job(("c", False)), "s", "; use Local")


def test_rows_of():
    assert rows_of(np.zeros((3, 2))) == 3 and rows_of([1, 2]) == 2 and rows_of(5) is None


def test_a_dropped_worker_is_a_record_reported_as_code_and_message():
    cohort = Cohort(["a", "b", "c"])
    lost = WorkerCallError("b", ErrorInfo(code=ErrorCode.WORKER_LOST, message="gone"))
    crashed = WorkerCallError("c", ErrorInfo(code=ErrorCode.DAEMON_CRASHED, message="died"))
    dropped = [cohort.drop(1, lost), cohort.drop(2, crashed)]
    assert dropped[0] == DroppedWorker("b", ErrorCode.WORKER_LOST, "gone")
    assert reasons(dropped) == {"b": "worker_lost: gone", "c": "daemon_crashed: died"}
    assert cohort.usable() == [0, 2] and cohort.ready() == [0]
    assert listed([]) == "no worker failed"
    assert DroppedWorker("a", None, "its dataset has no rows").reason == "its dataset has no rows"
