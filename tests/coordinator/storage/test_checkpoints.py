"""coordinator.storage.checkpoints: atomic, verified checkpoint files, and when a run saves
one."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import zlib

import numpy as np
import pytest
import torch

from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.storage.checkpoints import (
    CheckpointPolicy,
    CheckpointStore,
    JobCheckpoints,
)
from coordinator.storage.kept_files import piece_bytes
from protocol.errors import ErrorCode, ErrorInfo


def _payload(k: float) -> dict:
    return {
        "states": {"net": {"weight": torch.full((3, 2), k), "bias": torch.zeros(3)}},
        "optimizers": {"net": {"state": {0: {"momentum_buffer": torch.ones(3, 2) * k}}}},
        "plain": {"center": np.arange(4.0) * k},
    }


def test_a_checkpoint_reads_back_as_it_was_saved(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    saved = store.write("job1", {"step": 40, "epoch": 2}, _payload(1.5), keep=2)
    latest = store.latest("job1")
    assert latest is not None and latest.seq == saved.seq == 1
    assert latest.position == {"step": 40, "epoch": 2}
    torch.testing.assert_close(latest.payload["states"]["net"]["weight"], torch.full((3, 2), 1.5))
    momentum = latest.payload["optimizers"]["net"]["state"][0]["momentum_buffer"]
    torch.testing.assert_close(momentum, torch.ones(3, 2) * 1.5)
    np.testing.assert_array_equal(latest.payload["plain"]["center"], np.arange(4.0) * 1.5)
    assert (
        latest.nbytes
        == saved.nbytes
        == (tmp_path / "checkpoints/job1/00000001.ckpt").stat().st_size
    )
    assert (tmp_path / "checkpoints").stat().st_mode & 0o777 == 0o700
    assert store.latest("other") is None


def test_only_the_last_ones_are_kept_and_the_latest_wins(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (10, 20, 30, 40):
        store.write("j", {"step": step}, _payload(step), keep=2)
    assert store.positions("j") == [(3, {"step": 30}), (4, {"step": 40})]
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 40}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "checksum", "empty"])
def test_a_torn_or_damaged_checkpoint_is_never_used_the_one_before_is(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 10}, _payload(1.0), keep=2)
    store.write("j", {"step": 20}, _payload(2.0), keep=2)
    newest = tmp_path / "j" / "00000002.ckpt"
    raw = bytearray(newest.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "flipped":
        raw[len(raw) // 3] ^= 0xFF
    elif damage == "checksum":
        raw[-1] ^= 0x01
    else:
        raw = bytearray()
    newest.write_bytes(bytes(raw))
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 10}
    assert store.positions("j") == [(1, {"step": 10})]


def test_a_checkpoints_file_is_its_frame_then_a_tag_and_the_frames_crc32(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 10}, _payload(1.0), keep=2)
    raw = (tmp_path / "j" / "00000001.ckpt").read_bytes()
    assert raw[-9:-4] == b"crc32"
    assert int.from_bytes(raw[-4:], "big") == zlib.crc32(raw[:-9])


def test_a_checkpoint_written_with_a_sha256_before_the_crc32_reads_back(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 10}, _payload(1.0), keep=3)
    store.write("j", {"step": 20}, _payload(2.0), keep=3)
    for seq in (1, 2):  # as an older coordinator wrote them: the frame, then its SHA-256
        path = tmp_path / "j" / f"{seq:08d}.ckpt"
        frame = path.read_bytes()[:-9]
        path.write_bytes(frame + hashlib.sha256(frame).digest())
    newest = tmp_path / "j" / "00000002.ckpt"
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 20}
    torch.testing.assert_close(latest.payload["states"]["net"]["weight"], torch.full((3, 2), 2.0))
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    newest.write_bytes(bytes(raw))
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 10}


def test_a_write_that_never_finished_leaves_the_previous_checkpoint_standing(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 10}, _payload(1.0), keep=2)
    (tmp_path / "j" / "00000002.ckpt.partial").write_bytes(b"half a checkpoint")  # killed mid-write
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 10}
    again = store.write("j", {"step": 20}, _payload(2.0), keep=2)  # the next one is whole
    assert again.seq == 2 and not (tmp_path / "j" / "00000002.ckpt.partial").exists()


@pytest.mark.parametrize(("keep", "left"), [(1, [1]), (2, [2])])
def test_a_write_the_disk_refuses_keeps_the_checkpoints_before_it(
    tmp_path, monkeypatch, keep, left
):
    """All of them; but where it was written over the file of the one it retires (``keep`` of
    2 or more), that one, which was due to go, is gone."""
    store = CheckpointStore(tmp_path)
    for step in range(1, keep + 1):
        store.write("j", {"step": 10 * step}, _payload(step), keep=keep)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.write("j", {"step": 99}, _payload(9.0), keep=keep)
    monkeypatch.undo()
    assert [seq for seq, _ in store.positions("j")] == left
    assert [p.name for p in (tmp_path / "j").iterdir()] == [f"{seq:08d}.ckpt" for seq in left]
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 10 * left[-1]}


def test_a_new_checkpoint_is_written_over_the_file_of_the_one_it_retires(tmp_path):
    store = CheckpointStore(tmp_path)
    big = _payload(1.0) | {"plain": {"center": np.arange(50_000.0)}}  # longer than the next
    store.write("j", {"step": 10}, big, keep=2)
    store.write("j", {"step": 20}, _payload(2.0), keep=2)
    first = os.stat(tmp_path / "j" / "00000001.ckpt")
    store.write("j", {"step": 30}, _payload(3.0), keep=2)
    third = os.stat(tmp_path / "j" / "00000003.ckpt")
    assert (third.st_dev, third.st_ino) == (first.st_dev, first.st_ino)
    assert third.st_size < first.st_size  # cut to its own length
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["00000002.ckpt", "00000003.ckpt"]
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 30}
    np.testing.assert_array_equal(latest.payload["plain"]["center"], np.arange(4.0) * 3.0)


def test_a_checkpoint_is_written_afresh_while_fewer_than_keep_stand(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in range(1, 8):
        store.write("j", {"step": step}, _payload(step), keep=10)
    assert [seq for seq, _ in store.positions("j")] == [1, 2, 3, 4, 5, 6, 7]
    inodes = {os.stat(tmp_path / "j" / f"{seq:08d}.ckpt").st_ino for seq in range(1, 8)}
    assert len(inodes) == 7


def test_job_ids_cannot_name_other_directories_and_drop_removes_a_jobs_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "c")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="not a job id"):
            store.write(bad, {}, {}, keep=1)
    store.write("j", {"step": 1}, {}, keep=1)
    store.drop("j")
    assert store.latest("j") is None and not (tmp_path / "c" / "j").exists()


def test_policy_every_n_steps_and_at_the_end_or_never_with_zero():
    policy = CheckpointPolicy(every=3, per_epoch=10, clock=lambda: 0.0)
    assert [s for s in range(1, 11) if policy.due(s, 10)] == [3, 6, 9, 10]
    assert [policy.next_due(s, 10) for s in (0, 3, 8, 9)] == [3, 6, 9, 10]
    off = CheckpointPolicy(every=0, per_epoch=10, clock=lambda: 0.0)
    assert not any(off.due(s, 100) for s in range(1, 101))
    assert off.next_due(5, 100) == 100


def test_policy_by_default_saves_every_epoch_or_after_a_minute_whichever_comes_first():
    now = [0.0]
    policy = CheckpointPolicy(every=None, per_epoch=4, clock=lambda: now[0], seconds=60.0)
    policy.start()
    assert [s for s in range(1, 13) if policy.due(s, 12)] == [4, 8, 12]  # the end too
    assert policy.next_due(5, 12) == 8
    now[0] = 59.0
    assert not policy.due(5, 12)
    now[0] = 61.0
    assert policy.due(5, 12)  # a minute of training since the start
    policy.saved()
    assert not policy.due(6, 12)


SHARDS = {".metadata": b"where each shard lies", "__0_0.distcp": b"a" * 10, "__1_0.distcp": b"b"}


def _written(store, job_id, shards):
    """``shards`` written as the next checkpoint's files, a few bytes at a time."""
    writer = store.shards_writer(job_id)
    for name, data in shards.items():
        file = writer.open(name)
        for at in range(0, len(data), 3):
            file.write(data[at : at + 3])
        writer.close(file)
    return writer


def _sharded(k: int) -> dict:
    return {"shards": {"by_replica": [[".metadata", "__0_0.distcp"], ["__1_0.distcp"]], "k": k}}


def test_a_sharded_checkpoint_keeps_each_replicas_files_beside_it_listed_by_digest(tmp_path):
    store = CheckpointStore(tmp_path)
    saved = store.write("j", {"step": 5}, _sharded(1), keep=2, shards=_written(store, "j", SHARDS))
    folder = tmp_path / "j" / "00000001.shards"
    assert sorted(p.name for p in folder.iterdir()) == sorted(SHARDS)
    latest = store.latest("j")
    assert latest is not None and latest.shards == folder == saved.shards
    listed = latest.payload["shards"]["files"]
    for name, data in SHARDS.items():
        assert listed[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert latest.shard(name) == data
    assert latest.payload["shards"]["k"] == 1
    # Read alone, without every file hashed first: each is checked as it is read.
    unverified = store.read("j", 1, verify=False)
    name = sorted(SHARDS)[0]
    assert unverified.shard(name, verify=True) == SHARDS[name]
    (folder / name).write_bytes(bytes(len(SHARDS[name])))  # damaged, not torn: same size
    assert store.read("j", 1, verify=False).shard(name) == bytes(len(SHARDS[name]))
    with pytest.raises(ValueError, match=f"file {name} is damaged"):
        unverified.shard(name, verify=True)
    with pytest.raises(ValueError, match=f"file {name} is damaged"):
        store.read("j", 1)
    (folder / name).write_bytes(SHARDS[name])
    file_size = (tmp_path / "j" / "00000001.ckpt").stat().st_size
    assert latest.nbytes == saved.nbytes == file_size + sum(len(d) for d in SHARDS.values())
    with pytest.raises(FileNotFoundError, match="no shards' file 'other'"):
        latest.shard("other")
    for k in (2, 3):
        store.write("j", {"step": 5 * k}, _sharded(k), keep=2, shards=_written(store, "j", SHARDS))
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "00000002.ckpt",
        "00000002.shards",
        "00000003.ckpt",
        "00000003.shards",
    ]
    store.keep_newest("j")
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "00000003.ckpt",
        "00000003.shards",
    ]


def test_a_sharded_checkpoints_file_is_read_in_ranges_each_checked_for_its_size(tmp_path):
    """As a client or a resumed replica is given it: a piece at a time, its size checked
    (the digest is the reader's to check once it has them all)."""
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 5}, _sharded(1), keep=2, shards=_written(store, "j", SHARDS))
    saved = store.read("j", 1)
    data = SHARDS[".metadata"]
    pieces = [saved.shard_range(".metadata", at, 4) for at in range(0, len(data), 4)]
    assert b"".join(pieces) == data and {len(p) for p in pieces[:-1]} == {4}
    assert saved.shard_range(".metadata", len(data), 4) == b""  # past its end: nothing
    with pytest.raises(FileNotFoundError, match="no shards' file 'other'"):
        saved.shard_range("other", 0, 4)
    (tmp_path / "j" / "00000001.shards" / ".metadata").write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"file \.metadata is torn"):
        saved.shard_range(".metadata", 0, 4)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "gone"])
def test_a_sharded_checkpoint_whose_shards_are_damaged_is_never_used(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    store.write("j", {"step": 5}, _sharded(1), keep=2, shards=_written(store, "j", SHARDS))
    store.write("j", {"step": 10}, _sharded(2), keep=2, shards=_written(store, "j", SHARDS))
    shard = tmp_path / "j" / "00000002.shards" / "__0_0.distcp"
    if damage == "flipped":  # same size: only its digest tells
        shard.write_bytes(b"a" * 9 + b"x")
    elif damage == "truncated":
        shard.write_bytes(b"a" * 4)
    else:
        shard.unlink()
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 5}
    with pytest.raises((OSError, ValueError)):
        store.read("j", 2)


class _Left:
    """A sharded checkpoint's files as its workers left them: read in pieces, each read said,
    the last ``fail_after`` reads (if set) failing as a lost worker's would."""

    def __init__(self, files, fail_after=None):
        self.files = files
        self.reads: list[tuple[str, int, int]] = []
        self.fail_after = fail_after
        self.released = 0

    def sizes(self):
        return {name: len(data) for name, data in self.files.items()}

    async def read(self, name, offset, length):
        if self.fail_after is not None and len(self.reads) >= self.fail_after:
            info = ErrorInfo(code=ErrorCode.WORKER_LOST, message="lost during read_kept")
            raise WorkerCallError("w1", info)
        self.reads.append((name, offset, length))
        return self.files[name][offset : offset + length]

    async def release(self):
        self.released += 1


def _saving(store, left, position):
    events = []

    async def emit(event, data):
        events.append((event, data))

    async def go():
        saves = JobCheckpoints("j", store, keep=2, emit=emit, piece_bytes=4)
        await saves.save(position, _sharded(position["step"]), left)
        return await saves.flush()

    return asyncio.run(go()), events


def test_a_sharded_checkpoints_files_are_read_a_piece_at_a_time_into_the_store(tmp_path):
    """The coordinator holds at most two pieces of a file at once: each is read in pieces of
    ``piece_bytes``, written as the next is read, and the files are released where they were
    left once the checkpoint is whole."""
    store = CheckpointStore(tmp_path)
    left = _Left(SHARDS)
    written, events = _saving(store, left, {"step": 5})
    assert written is True and left.released == 1
    assert max(length for _, _, length in left.reads) == 4
    assert [(o, n) for name, o, n in left.reads if name == "__0_0.distcp"] == [
        (0, 4),
        (4, 4),
        (8, 2),
    ]
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 5}
    assert {name: latest.shard(name, verify=True) for name in SHARDS} == SHARDS
    checkpoint = [d for e, d in events if e == "checkpoint"]
    assert checkpoint[0]["bytes"] == latest.nbytes


@pytest.mark.parametrize("fault", ["lost", "bad name"])
def test_shards_that_cannot_be_read_or_written_leave_no_folder_and_the_one_before_stands(
    tmp_path, fault
):
    store = CheckpointStore(tmp_path)
    assert _saving(store, _Left(SHARDS), {"step": 5})[0] is True
    if fault == "lost":  # its worker gone in the middle of a file
        left = _Left(SHARDS, fail_after=2)
        said = "lost during read_kept"
    else:
        left = _Left({"../escape": b"x"})
        said = "not a shards' file name"
    written, events = _saving(store, left, {"step": 10})
    assert written is False and left.released == 1
    failed = [d for e, d in events if e == "checkpoint_failed"]
    assert failed[0]["step"] == 10 and said in failed[0]["error"]
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "00000001.ckpt",
        "00000001.shards",
    ]
    assert not (tmp_path / "escape").exists()
    latest = store.latest("j")
    assert latest is not None and latest.position == {"step": 5}


def test_a_coordinator_reads_pieces_that_fit_its_room_for_replies():
    assert piece_bytes(4 << 30) == 16 << 20  # the default room: 16 MiB pieces
    assert piece_bytes(8 << 20) == 2 << 20  # a quarter of a small room
    assert piece_bytes(1000) == 64 << 10  # and never under 64 KiB


@pytest.mark.parametrize("fault", [None, "lost", "refused"])
def test_a_payload_read_as_the_write_starts_is_saved_or_its_failure_said(tmp_path, fault):
    """A payload given as a coroutine function (a DiLoCo checkpoint read from the workers the
    replicas left it on) is awaited once the write starts, after the caller went on: saved
    as it came, or, when its worker was lost or its part refused, ``checkpoint_failed`` says
    why and the checkpoint before stands."""
    store = CheckpointStore(tmp_path)
    events = []
    reads = []

    async def emit(event, data):
        events.append((event, data))

    async def payload():
        reads.append("read")
        if fault == "lost":
            raise WorkerCallError("w1", ErrorInfo(code=ErrorCode.WORKER_LOST, message="gone"))
        if fault == "refused":
            raise StrategyFailed(ErrorCode.STATE_MISMATCH, "replica 1's part lacks its state")
        return _payload(2.0)

    async def go():
        saves = JobCheckpoints("j", store, keep=2, emit=emit)
        await saves.save({"step": 1}, _payload(1.0))
        await saves.save({"step": 2}, payload)
        went_on = list(reads)  # (save returned before the payload was read)
        return went_on, await saves.flush()

    went_on, written = asyncio.run(go())
    assert went_on == [] and reads == ["read"]
    assert written is (fault is None)
    latest = store.latest("j")
    assert latest is not None
    if fault is None:
        assert latest.position == {"step": 2}
        torch.testing.assert_close(latest.payload["states"], _payload(2.0)["states"])
    else:
        assert latest.position == {"step": 1}
        failed = [d for e, d in events if e == "checkpoint_failed"]
        said = "gone" if fault == "lost" else "lacks its state"
        assert failed[0]["step"] == 2 and said in failed[0]["error"]
