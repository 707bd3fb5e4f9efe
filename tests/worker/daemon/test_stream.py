"""A bare ``python -m worker.daemon`` driven by hand, for what a well-behaved supervisor never
sends: broken frames, and a stream that cannot be read any more."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from protocol.codec import decode, encode
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from tests.utils import UNIT
from tests.worker.daemon.supervised import Printer
from worker.daemon.pipe import LENGTH, FrameReader, FrameWriter

pytestmark = pytest.mark.integration


# -- the bare daemon, driven by hand -------------------------------------------------------------


class RawDaemon:
    """``python -m worker.daemon`` with blocking pipes and no supervisor in the way."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.daemon", "--threads", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.reader = FrameReader()

    def send_raw(self, data: bytes) -> None:
        self.stdin.write(data)
        self.stdin.flush()

    def send(self, message: Any) -> None:
        writer = FrameWriter(encode(message))
        self.send_raw(b"".join(bytes(v) for v in writer.buffers(limit=1000)))

    def recv(self) -> dict[str, Any]:
        deadline = time.monotonic() + 20 * UNIT
        while True:
            ready, _, _ = select.select([self.stdout], [], [], max(0, deadline - time.monotonic()))
            assert ready, "no reply from the daemon"
            n = os.readv(self.stdout.fileno(), [self.reader.buffer()])
            assert n > 0, "the daemon closed its stdout"
            frame = self.reader.advance(n)
            if frame is not None:
                return decode(frame)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def raw() -> Iterator[RawDaemon]:
    daemon = RawDaemon()
    try:
        yield daemon
    finally:
        daemon.close()


def test_bad_frames_get_replies_until_the_stream_itself_breaks(raw):
    raw.send_raw(LENGTH.pack(9) + b"not json!")
    reply = raw.recv()
    assert reply["id"] == -1 and reply["error"]["code"] == ErrorCode.BAD_FRAME

    raw.send([1, 2, 3])
    assert raw.recv()["error"]["code"] == ErrorCode.BAD_REQUEST
    raw.send({"id": 7, "cmd": "fit", "node_id": 3, "x": 1})
    reply = raw.recv()
    assert reply["id"] == 7 and reply["error"]["detail"]["field"] == "node_id"

    raw.send({"id": 8, "cmd": "load", "filters": {"printer": dump_filter(Printer())}})
    assert raw.recv() == {"id": 8, "ok": True, "result": ["printer"]}
    raw.send({"id": 9, "cmd": "forward", "node_id": "printer", "x": [1.5], "state": {}})
    assert raw.recv() == {"id": 9, "ok": True, "result": [1.5]}
    raw.send({"id": 10, "cmd": "ping"})
    assert raw.recv() == {"id": 10, "ok": True, "result": None}

    # A length prefix that cannot be right: the next frame cannot be found, so it says why
    # and exits.
    raw.send_raw(LENGTH.pack(2**62))
    reply = raw.recv()
    assert reply["error"]["code"] == ErrorCode.BAD_FRAME and "broken" in reply["error"]["message"]
    assert raw.proc.wait(timeout=5 * UNIT) == 2
    assert raw.proc.stderr is not None
    stderr = raw.proc.stderr.read()
    assert b"printer: forward" in stderr and b"not a frame" in stderr


def test_eof_on_the_protocol_input_ends_the_daemon(raw):
    raw.send({"id": 1, "cmd": "ping"})
    assert raw.recv()["ok"] is True
    raw.stdin.close()
    assert raw.proc.wait(timeout=5 * UNIT) == 0
