"""The coordinator side of the torch collective that needs no worker: how chunks grow and which
failure a broken chunk is blamed on."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.errors import WorkerCallError
from coordinator.strategies.chunks import CHUNK_SECONDS, MAX_CHUNK, next_chunk
from coordinator.strategies.process_group import Broken, settle
from protocol.errors import ErrorCode, ErrorInfo


def error(worker: str, code: ErrorCode) -> WorkerCallError:
    return WorkerCallError(worker, ErrorInfo(code=code, message=f"{code} on {worker}"))


def test_chunks_double_while_fast_halve_when_slow_and_stay_bounded():
    assert next_chunk(1, 1, CHUNK_SECONDS / 10) == 2
    assert next_chunk(8, 8, CHUNK_SECONDS) == 8
    assert next_chunk(8, 8, CHUNK_SECONDS * 3) == 4
    assert next_chunk(1, 1, CHUNK_SECONDS * 3) == 1
    assert next_chunk(MAX_CHUNK, MAX_CHUNK, 0.0) == MAX_CHUNK
    assert next_chunk(8, 3, 0.0) == 8  # a short last chunk says nothing about the speed


def test_a_broken_chunk_is_blamed_on_the_lost_worker_not_on_the_survivor_that_saw_it():
    survivor = error("w1", ErrorCode.COLLECTIVE_FAILED)
    lost = error("w2", ErrorCode.WORKER_LOST)
    assert Broken({0: survivor, 1: lost}, {0: 3}).blame() is lost
    own = error("w2", ErrorCode.FILTER_ERROR)
    assert Broken({0: survivor, 1: own}, {0: 3}).blame() is own
    assert Broken({0: survivor}, {0: 3}).blame() is survivor


def _fails(code: ErrorCode, worker: str, after: float, **detail):
    async def call():
        await asyncio.sleep(after)
        raise WorkerCallError(worker, ErrorInfo(code=code, message=f"{code}", detail=detail))

    return call()


async def _answers(after: float, value):
    await asyncio.sleep(after)
    return value


def test_settle_cancels_the_rest_as_soon_as_a_member_is_known_lost():
    async def main():
        calls = {
            0: _fails(ErrorCode.COLLECTIVE_FAILED, "w1", 0.01, steps_done=4),
            1: _fails(ErrorCode.WORKER_LOST, "w2", 0.05),
            2: _answers(30.0, "never"),  # hung in a collective
        }
        started = time.monotonic()
        with pytest.raises(Broken) as broken:
            await settle(calls, ["w1", "w2", "w3"], 60.0, 5)
        return broken.value, time.monotonic() - started

    broken, took = asyncio.run(main())
    assert took < 5.0  # neither the hung call's 30 s nor the 60 s grace
    assert broken.blame().worker_id == "w2"
    assert broken.done == {0: 4}
    assert broken.errors[2].code is ErrorCode.DAEMON_CRASHED  # cancelled: its daemon stopped
    assert broken.stopped == {2}


def test_a_member_stopped_here_is_never_blamed_over_the_one_that_was_lost():
    stopped = error("w1", ErrorCode.DAEMON_CRASHED)
    lost = error("w2", ErrorCode.WORKER_LOST)
    assert Broken({0: stopped, 1: lost}, {}, frozenset({0})).blame() is lost


def test_a_patient_settle_lets_survivors_end_within_the_grace_then_stops_the_hung():
    async def main():
        calls = {
            0: _fails(ErrorCode.WORKER_LOST, "w1", 0.01),
            1: _fails(ErrorCode.COLLECTIVE_FAILED, "w2", 0.1, steps_done=7),
            2: _answers(0.2, {"losses": []}),  # had finished its chunk
            3: _answers(30.0, "never"),
        }
        with pytest.raises(Broken) as broken:
            await settle(calls, ["w1", "w2", "w3", "w4"], 0.5, 8, patient=True)
        return broken.value

    broken = asyncio.run(main())
    assert broken.done == {1: 7, 2: 8}
    assert "did not leave the broken group within 0.5s" in broken.errors[3].info.message
    assert sorted(broken.errors) == [0, 1, 3]
