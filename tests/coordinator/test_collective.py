"""The coordinator side of the torch collective that needs no worker: how chunks grow and which
failure a broken chunk is blamed on."""

from __future__ import annotations

from coordinator.errors import WorkerCallError
from coordinator.strategies.collective import CHUNK_SECONDS, MAX_CHUNK, _next_chunk
from coordinator.strategies.process_group import Broken
from protocol.errors import ErrorCode, ErrorInfo


def error(worker: str, code: ErrorCode) -> WorkerCallError:
    return WorkerCallError(worker, ErrorInfo(code=code, message=f"{code} on {worker}"))


def test_chunks_double_while_fast_halve_when_slow_and_stay_bounded():
    assert _next_chunk(1, 1, CHUNK_SECONDS / 10) == 2
    assert _next_chunk(8, 8, CHUNK_SECONDS) == 8
    assert _next_chunk(8, 8, CHUNK_SECONDS * 3) == 4
    assert _next_chunk(1, 1, CHUNK_SECONDS * 3) == 1
    assert _next_chunk(MAX_CHUNK, MAX_CHUNK, 0.0) == MAX_CHUNK
    assert _next_chunk(8, 3, 0.0) == 8  # a short last chunk says nothing about the speed


def test_a_broken_chunk_is_blamed_on_the_lost_worker_not_on_the_survivor_that_saw_it():
    survivor = error("w1", ErrorCode.COLLECTIVE_FAILED)
    lost = error("w2", ErrorCode.WORKER_LOST)
    assert Broken({0: survivor, 1: lost}, {0: 3}).blame() is lost
    own = error("w2", ErrorCode.FILTER_ERROR)
    assert Broken({0: survivor, 1: own}, {0: 3}).blame() is own
    assert Broken({0: survivor}, {0: 3}).blame() is survivor
