"""The worker agent's jobs against a coordinator stand-in: open, call, fail, crash, close, stop.

Real sockets and real filter daemons (see :mod:`tests.worker.standin`); every test checks that
no process of it is left behind.
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
import time

import pytest
import torch

import somatize as sz
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Ack, Call, CloseJob, ReadKept, Status
from tests.utils import UNIT, Boom, Center
from tests.worker.standin import (
    Die,
    Sleep,
    StandIn,
    call,
    call_error,
    drive,
    gone,
    no_process_left,
    open_job,
    running,
)

pytestmark = pytest.mark.integration

__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

# -- jobs ---------------------------------------------------------------------------------------


def test_batched_fit_over_the_wire_matches_graph_fit():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(4, 3), lr=0.1, batch_size=8, epochs=3, seed=1)
    fitted = (Center().named("center") >> copy.deepcopy(net).named("lin")).fit(x, y)
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", center=Center(), lin=net)
            result = await call(channel, "j", "batched_fit", node_ids=["center", "lin"], x=x, y=y)
        assert result["rows"] == 32 and len(result["epoch_losses"]) == 3
        assert set(result["states"]["lin"]) == set(fitted.states["lin"])
        for key, value in fitted.states["lin"].items():
            torch.testing.assert_close(result["states"]["lin"][key], value, rtol=0, atol=0)
        torch.testing.assert_close(result["states"]["center"]["mean"], x.mean(0))
        assert result["loss"] == pytest.approx(fitted.epoch_losses[-1], rel=1e-6)

    drive(main)


def test_a_filter_that_raises_is_an_error_reply_and_the_next_call_works():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-1"):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", boom=Boom(), center=Center())
            error = await call_error(channel, "j", "fit", node_id="boom", x=torch.ones(2, 2))
            assert error.code == ErrorCode.FILTER_ERROR
            assert "boom in fit" in error.message
            assert "in explode" in error.detail["traceback"]
            assert error.detail["worker_id"] == "w-1" and error.detail["job_id"] == "j"

            result = await call(channel, "j", "fit", node_id="center", x=torch.ones(2, 2))
            torch.testing.assert_close(result["states"]["center"]["mean"], torch.ones(2))

    drive(main)


def test_a_killed_daemon_is_daemon_crashed_until_the_job_is_opened_again():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-crash") as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", die=Die(), center=Center())
            first_pid = agent.jobs["j"].pid
            assert first_pid is not None

            error = await call_error(channel, "j", "fit", node_id="die", x=[1.0])
            assert error.code == ErrorCode.DAEMON_CRASHED
            assert error.detail["signal"] == "SIGKILL"
            assert error.detail["worker_id"] == "w-crash" and error.detail["job_id"] == "j"
            assert gone(first_pid)
            # Never a silent success afterwards, not even for a harmless command.
            again = await call_error(channel, "j", "fit", node_id="center", x=torch.ones(1, 2))
            assert again.code == ErrorCode.DAEMON_CRASHED
            assert again.detail["job_id"] == "j"

            await open_job(channel, "j", center=Center())
            assert agent.jobs["j"].pid not in (None, first_pid)
            result = await call(channel, "j", "fit", node_id="center", x=torch.ones(1, 2))
            assert set(result["states"]) == {"center"}

    drive(main)


def test_unknown_jobs_and_unknown_kinds_get_typed_errors():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-1"):
            channel = await stand_in.next_channel()
            error = await call_error(channel, "nope", "ping")
            assert error.code == ErrorCode.UNKNOWN_JOB
            assert error.detail == {"worker_id": "w-1", "job_id": "nope"}
            assert "nope" in error.message and "w-1" in error.message

            assert isinstance(await channel.request(CloseJob(job_id="nope"), 5 * UNIT), Ack)
            with pytest.raises(RemoteError) as info:
                await channel.request(Status(), 5 * UNIT)
            assert info.value.code == ErrorCode.BAD_REQUEST
            assert "status" in info.value.info.message

    drive(main)


def test_close_job_during_a_long_call_fails_the_call():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in) as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", sleep=Sleep(60))
            pid = agent.jobs["j"].pid
            assert pid is not None
            pending = asyncio.ensure_future(call(channel, "j", "fit", node_id="sleep", x=[1.0]))
            await asyncio.sleep(0.3 * UNIT)  # the daemon is inside fit now
            assert not pending.done()

            started = time.monotonic()
            assert isinstance(await channel.request(CloseJob(job_id="j"), 10 * UNIT), Ack)
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(pending, 10 * UNIT)
            assert info.value.code == ErrorCode.CANCELLED
            assert info.value.info.detail["job_id"] == "j"
            assert time.monotonic() - started < 5 * UNIT
            assert gone(pid) and agent.jobs == {}

    drive(main)


def test_files_a_call_keeps_are_read_in_pieces_and_go_with_their_job_and_the_agent(
    tmp_path, monkeypatch
):
    """``Call.keep``: the files stay in the agent's own folder (``0700``) until read; another
    job cannot read them, and they go when their job closes and with the agent."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    files = {".metadata": b"where each shard lies", "__0_0.distcp": bytes(range(256)) * 4}
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", center=Center())
            await open_job(channel, "other", center=Center())
            await call(channel, "j", "set_state", states={"center": files})
            ask = {"cmd": "get_state", "node_ids": ["center"]}
            reply = await channel.request(
                Call(job_id="j", request=ask, keep=["center"]), timeout=30 * UNIT
            )
            kept = reply.result["center"]
            assert kept["files"] == {name: len(data) for name, data in files.items()}
            (folder,) = tmp_path.glob("somatize-kept-*")
            assert folder.stat().st_mode & 0o777 == 0o700
            on_disk = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
            assert on_disk == files

            def read(job_id: str, at: int) -> ReadKept:
                return ReadKept(
                    job_id=job_id, kept=kept["kept"], name="__0_0.distcp", offset=at, length=600
                )

            pieces = [(await channel.request(read("j", at), 10 * UNIT)).result for at in (0, 600)]
            assert [len(p) for p in pieces] == [600, 424]
            assert b"".join(pieces) == files["__0_0.distcp"]
            with pytest.raises(RemoteError) as refused:  # another job's files are not its own
                await channel.request(read("other", 0), 10 * UNIT)
            assert refused.value.code == ErrorCode.BAD_REQUEST
            assert isinstance(await channel.request(CloseJob(job_id="j"), 10 * UNIT), Ack)
            assert not [p for p in folder.rglob("*") if p.is_file()]
            with pytest.raises(RemoteError) as closed:
                await channel.request(read("j", 0), 10 * UNIT)
            assert closed.value.code == ErrorCode.UNKNOWN_JOB
            await call(channel, "other", "set_state", states={"center": files})
            await channel.request(Call(job_id="other", request=ask, keep=["center"]), 30 * UNIT)
        assert list(tmp_path.glob("somatize-kept-*")) == []  # gone with the agent

    drive(main)


def test_stop_answers_a_running_call_with_an_error_and_refuses_new_jobs():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in) as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", sleep=Sleep(60))
            pid = agent.jobs["j"].pid
            assert pid is not None
            pending = asyncio.ensure_future(call(channel, "j", "fit", node_id="sleep", x=[1.0]))
            await asyncio.sleep(0.3 * UNIT)  # the daemon is inside fit now

            agent.stop()
            # Sent at once: it arrives while the daemons are being closed, before the goodbye.
            late = asyncio.ensure_future(open_job(channel, "k", sleep=Sleep(1)))
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(pending, 10 * UNIT)
            assert info.value.code == ErrorCode.CANCELLED  # answered, not cut off
            with pytest.raises(RemoteError) as refused:
                await asyncio.wait_for(late, 10 * UNIT)
            assert refused.value.code == ErrorCode.SHUTTING_DOWN
            await asyncio.wait_for(channel.closed.wait(), 10 * UNIT)
            assert gone(pid)

    drive(main)
