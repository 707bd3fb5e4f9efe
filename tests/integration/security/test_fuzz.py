"""Bad input: random and mutated frames at a live coordinator and a live agent.

Hypothesis builds WebSocket messages — random bytes; valid frames of every message kind, as they
are or mutated (bit flips, truncation, the header's JSON replaced, fields of the wrong type,
huge declared lengths); bogus and partial chunk streams; unknown kinds; text messages; one
message over the WebSocket limit — and sends them to a real coordinator's ``/client`` and
``/worker`` and to a real agent's ``/peer``, each before and after a valid hello (``/peer``
only before: its hello needs a job's peer secret, and what a link with one takes is
:mod:`tests.worker.test_peer_auth`'s). After each
example's messages a *sentinel* request goes down the same connection: its answer (or a clean
close of the connection) must come within a bound, so a hang or a stuck reading loop fails the
example. Every message that comes back must be a valid frame of the protocol, no error may be
``internal`` (a bug on the answering side), no close may be abnormal (1006) or an internal error
(1011), and the processes' logs must hold no traceback. Afterwards both processes are alive and
a normal job succeeds on the same coordinator, on that agent.

One connection per target is kept across examples and reopened only after a close, so the run
stays fast; ``FUZZ_EXAMPLES`` bounds it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest
import torch
import uvloop
import websockets
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from websockets.exceptions import ConnectionClosed

import somatize as sz
from protocol.chunking import CHUNK_MAGIC, Reassembler
from protocol.codec import encode
from protocol.errors import ErrorCode, ErrorInfo
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Call,
    Cancel,
    Capabilities,
    ClientHello,
    CloseJob,
    DatasetSummary,
    Deliver,
    Error,
    GetJob,
    GetQueue,
    GetResult,
    GraphSpec,
    Heartbeat,
    JobEvent,
    Links,
    ListJobs,
    NodeInfo,
    OpenJob,
    PeerHello,
    PeerRoute,
    Ping,
    Probe,
    Result,
    Shutdown,
    Status,
    StrategySpec,
    Submit,
    Watch,
    Welcome,
    WorkerHello,
)
from protocol.parsing import dump, parse
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Center

pytestmark = pytest.mark.integration

log = logging.getLogger(__name__)

FUZZ_EXAMPLES = 600
"""Hypothesis examples (each one to five messages, then a sentinel)."""
BOUND = 10 * UNIT
"""Seconds the answer to a sentinel, or the close of the connection, may take."""
CLEAN_CLOSES = {1000, 1001, 1008, 1009, 4000, 4002}
"""Close codes a refusal may use: normal, going away, policy, too big, heartbeat timeout (the
fuzzing worker sends none of its own), refused hello."""
SENTINEL_BASE = 10**12

# -- strategies ---------------------------------------------------------------------------------

texts = st.text(max_size=12)
names = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), min_size=1, max_size=12
)
"""What a worker id or tag may be (:data:`protocol.messages.WorkerName`); other values are the
mutations' job."""
ints = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)
maybe_text = st.none() | texts
seconds = st.floats(0, 3) | st.floats(0, 1e9)
periods = st.floats(1e-3, 1e6)
plain_json = st.recursive(
    st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
"""What orjson writes: a frame header's JSON."""
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | floats | st.text(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
arrays = st.builds(
    lambda n, dtype: np.arange(n).astype(dtype),
    st.integers(0, 8),
    st.sampled_from(["float32", "float64", "int64", "uint8", "bool"]),
)
anything = json_values | arrays | st.binary(max_size=32)
capabilities = st.builds(
    Capabilities, cpus=ints, memory_bytes=ints, torch=texts, python=texts, cloudpickle=texts
)
job_ids = texts | st.sampled_from(["job-1", "0", ""])
worker_ids = maybe_text | st.just("w1")


OPTION_KEYS = [
    *("workers", "worker", "tag", "rounds", "local_epochs", "fraction", "min_workers", "seed"),
    *("server", "mu", "partitions", "micro_batches", "schedule", "lr", "beta", "tau"),
]
option_values = json_values | st.lists(
    st.fixed_dictionaries(
        {"node_ids": st.lists(texts, max_size=3)},
        optional={"worker": maybe_text, "tag": maybe_text},
    ),
    max_size=3,
)


@st.composite
def submits(draw: st.DrawFn) -> Submit:
    """A submission the coordinator must judge: a known strategy with random options, a graph
    whose filters often match its nodes, data of any shape (filters are never valid pickles:
    such a job fails on the worker, it never runs user code)."""
    node_id = st.text(min_size=1, max_size=12)  # a node id is never empty
    node_ids = draw(st.lists(node_id, min_size=1, max_size=3))
    names = node_ids if draw(st.booleans()) else draw(st.lists(node_id, max_size=3))
    nodes = st.builds(  # (a TorchFilter's training options within their rules, or a plain node)
        NodeInfo,
        differentiable=st.booleans(),
        epochs=st.integers(0, 2**63 - 1),
        batch_size=st.none() | st.integers(1, 2**63 - 1),
        shuffle=st.booleans(),
        seed=ints,
    )
    return Submit(
        graph=GraphSpec(
            node_ids=node_ids,
            filters={n: draw(st.binary(max_size=16)) for n in names},
            nodes=draw(st.dictionaries(st.sampled_from(node_ids) | node_id, nodes, max_size=3)),
        ),
        x=draw(anything),
        y=draw(anything),
        dataset=draw(maybe_text),
        strategy=StrategySpec(
            name=draw(
                st.sampled_from(["local", "data_parallel", "fedavg", "fedprox", "model_parallel"])
                | texts
            ),
            options=draw(
                st.dictionaries(st.sampled_from(OPTION_KEYS) | texts, option_values, max_size=4)
            ),
        ),
    )


def _message_strategies() -> list[st.SearchStrategy[BaseModel]]:
    """One strategy per message kind of :mod:`protocol.messages`, valid as pydantic sees it."""
    reply = st.none() | ints
    return [
        st.builds(
            WorkerHello,
            worker_id=st.none() | names,
            tags=st.lists(names, max_size=3),
            capabilities=capabilities,
            peer_address=maybe_text,
            datasets=st.dictionaries(
                texts, st.builds(DatasetSummary, rows=st.integers(0, 10**9)), max_size=2
            ),
        ),
        st.builds(ClientHello, name=maybe_text),
        st.builds(
            Welcome,
            worker_id=maybe_text,
            heartbeat_interval=periods,
            heartbeat_timeout=periods,
            server=texts,
        ),
        st.builds(Heartbeat, sent_at=floats, job_id=maybe_text),
        st.builds(Shutdown, reason=texts),
        st.builds(Ack, reply_to=reply),
        st.builds(Result, result=anything, reply_to=reply),
        st.builds(
            Error,
            reply_to=reply,
            error=st.builds(ErrorInfo, code=st.sampled_from(ErrorCode), message=texts),
        ),
        st.builds(
            OpenJob,
            job_id=job_ids,
            filters=st.dictionaries(texts, st.binary(max_size=32), max_size=2),
            threads=st.none() | ints,
        ),
        st.builds(
            Call,
            job_id=job_ids,
            request=st.dictionaries(texts | st.just("cmd"), anything, max_size=3),
            timeout=st.none() | seconds,
            input_from=maybe_text,
            input_field=texts,
            output_to=st.none() | st.builds(PeerRoute, worker=worker_ids.filter(bool), key=texts),
        ),
        st.builds(Links, job_id=job_ids, peers=st.dictionaries(texts, maybe_text, max_size=2)),
        st.builds(
            Deliver,
            job_id=job_ids,
            to=worker_ids.filter(bool),
            key=texts,
            payload=st.binary(max_size=64),
        ),
        st.builds(PeerHello, worker_id=texts, job_id=job_ids, secret=texts),
        st.builds(Probe),
        st.builds(CloseJob, job_id=job_ids),
        submits(),
        st.builds(Watch, job_id=job_ids, after_seq=ints),
        st.builds(JobEvent, job_id=job_ids, seq=ints, time=floats, event=texts),
        st.builds(GetResult, job_id=job_ids, wait=seconds),
        st.builds(Cancel, job_id=job_ids),
        st.builds(GetJob, job_id=job_ids),
        st.builds(ListJobs, limit=st.integers(0, 1000)),
        st.builds(GetQueue),
        st.builds(Status),
        st.builds(Ping, worker_id=worker_ids),
    ]


messages = st.one_of(_message_strategies())
_PREFIX = struct.Struct("<I")
_CHUNK_HEAD = struct.Struct("<8sQQQ")


def _frame(message: BaseModel) -> bytes:
    return b"".join(encode(dump(message)))


@st.composite
def valid_frames(draw: st.DrawFn) -> bytes:
    return _frame(draw(messages))


@st.composite
def bit_flips(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(valid_frames()))
    for _ in range(draw(st.integers(1, 8))):
        bit = draw(st.integers(0, len(frame) * 8 - 1))
        frame[bit // 8] ^= 1 << (bit % 8)
    return bytes(frame)


@st.composite
def truncations(draw: st.DrawFn) -> bytes:
    frame = draw(valid_frames())
    return frame[: draw(st.integers(0, len(frame) - 1))]


@st.composite
def replaced_headers(draw: st.DrawFn) -> bytes:
    """The header's JSON replaced by random JSON (or a header with huge buffer lengths)."""
    frame = draw(valid_frames())
    (length,) = _PREFIX.unpack_from(frame)
    rest = frame[4 + length :]
    huge = st.integers(0, 2**64 - 1).map(lambda n: {"v": 1, "bufs": [n], "body": {"$bytes": 0}})
    header = orjson.dumps(draw(plain_json | huge))
    return _PREFIX.pack(len(header)) + header + rest


@st.composite
def wrong_fields(draw: st.DrawFn) -> bytes:
    """A field set to a value of any type, dropped, added, or an unknown kind."""
    body = dump(draw(messages))
    action = draw(st.sampled_from(["set", "drop", "add", "kind"]))
    key = draw(st.sampled_from(sorted(body)))
    if action == "set":
        body[key] = draw(anything)
    elif action == "drop":
        del body[key]
    elif action == "add":
        body[draw(texts)] = draw(anything)
    else:
        body["kind"] = draw(texts | json_values)
    return b"".join(encode(body))


@st.composite
def huge_lengths(draw: st.DrawFn) -> bytes:
    frame = draw(valid_frames())
    return _PREFIX.pack(draw(st.integers(len(frame), 2**32 - 1))) + frame[4:]


@st.composite
def bogus_chunks(draw: st.DrawFn) -> bytes:
    sizes = st.sampled_from([0, 1, 64, CHUNK_BYTES, 2**31, 2**62, 2**64 - 1]) | st.integers(
        0, 2**64 - 1
    )
    head = _CHUNK_HEAD.pack(
        CHUNK_MAGIC,
        draw(st.integers(0, 4) | st.integers(0, 2**64 - 1)),
        draw(sizes),
        draw(sizes),
    )
    return head + draw(st.binary(max_size=128))


@st.composite
def chunk_series(draw: st.DrawFn) -> list[bytes]:
    """A valid frame cut into chunk messages, maybe reordered or missing some."""
    frame = draw(valid_frames())
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(frame) - 1)), max_size=3)))
    bounds = [0, *cuts, len(frame)]
    stream = draw(st.integers(0, 8))
    chunks = [
        _CHUNK_HEAD.pack(CHUNK_MAGIC, stream, a, len(frame)) + frame[a:b]
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    return (
        draw(st.permutations(chunks))
        if draw(st.booleans())
        else chunks[: draw(st.integers(1, len(chunks)))]
    )


class Oversized:
    """One WebSocket message over the 4 MiB every endpoint takes (the peer closes with 1009);
    made when sent, so that hypothesis does not carry (or print) 4 MiB."""

    def __repr__(self) -> str:
        return "Oversized()"

    def payload(self) -> bytes:
        return bytes(4 * CHUNK_BYTES + 1)


Payload = bytes | str | Oversized

single = st.one_of(
    st.binary(max_size=256),
    valid_frames(),  # valid messages and wrong fields are most of what reaches the handlers
    valid_frames(),
    valid_frames(),
    wrong_fields(),
    bit_flips(),
    truncations(),
    replaced_headers(),
    wrong_fields(),
    huge_lengths(),
    bogus_chunks(),
    st.text(max_size=64),  # a text WebSocket message instead of a binary one
)
payloads = st.lists(
    st.one_of(
        single.map(lambda p: [p]),
        chunk_series(),
        st.sampled_from([[Oversized()], [b""], ["{}"]]),
    ),
    min_size=1,
    max_size=4,
).map(lambda groups: [p for group in groups for p in group])

TARGETS = ["client", "worker", "peer", *(["client+hello", "worker+hello"] * 2)]


# -- the fuzzer ---------------------------------------------------------------------------------


@dataclass
class _Link:
    ws: Any
    reassembler: Reassembler = field(default_factory=lambda: Reassembler(1 << 26))


@dataclass
class Fuzzer:
    """Sends the examples and checks what comes back; counts everything."""

    coordinator: str
    peer: str
    sent: int = 0
    sentinels: int = 0
    hellos: int = 0
    examples: int = 0
    links: dict[str, _Link] = field(default_factory=dict)
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    closes: collections.Counter[int] = field(default_factory=collections.Counter)
    next_sentinel: int = SENTINEL_BASE

    async def exchange(self, target: str, batch: list[Payload]) -> None:
        self.examples += 1
        path, _, hello = target.partition("+")
        link = await self._link(target) if hello else await self._open(path)
        for payload in batch:
            try:
                await link.ws.send(payload.payload() if isinstance(payload, Oversized) else payload)
            except ConnectionClosed:
                break  # refused and closed already: what comes back says how
            self.sent += 1
        await self._settle(target, path, link)

    async def _settle(self, target: str, path: str, link: _Link) -> None:
        """Send the sentinel and read until its answer or the close, within ``BOUND``."""
        self.next_sentinel += 1
        sentinel = self.next_sentinel
        probe = Status(id=sentinel) if path == "client" else Probe(id=sentinel)
        with contextlib.suppress(ConnectionClosed):
            await link.ws.send(_frame(probe))
            self.sentinels += 1
        try:
            async with asyncio.timeout(BOUND):
                while True:
                    message = self._check(link, await link.ws.recv())
                    if message is not None and message.reply_to == sentinel:
                        return
        except ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else 1006
            self.closes[code] += 1
            assert code in CLEAN_CLOSES, f"{target}: closed with {code} ({closed})"
            self.links.pop(target, None)
        except TimeoutError:
            raise AssertionError(f"{target}: no answer to the sentinel within {BOUND}s") from None
        finally:
            if "+" not in target:  # a connection of its own for each example before a hello
                await _close(link)

    def _check(self, link: _Link, raw: bytes | str) -> Any:
        """What came back must be a valid frame of the protocol, and no internal error."""
        assert isinstance(raw, bytes), f"a text message came back: {raw!r}"
        frame: Any = raw
        if raw[: len(CHUNK_MAGIC)] == CHUNK_MAGIC:
            frame = link.reassembler.add(raw)
            if frame is None:
                return None
        message = parse(frame)
        self.answers[message.error.code if isinstance(message, Error) else message.kind] += 1
        if isinstance(message, Error):
            assert message.error.code != ErrorCode.INTERNAL, message.error.message
        return message

    async def _open(self, path: str) -> _Link:
        url = self.peer + "/peer" if path == "peer" else f"{self.coordinator}/{path}"
        ws = await websockets.connect(url, compression=None, max_size=1 << 26, open_timeout=BOUND)
        return _Link(ws)

    async def _link(self, target: str) -> _Link:
        link = self.links.get(target)
        if link is not None:
            return link
        path = target.partition("+")[0]
        link = await self._open(path)
        hello: BaseModel
        if path == "client":
            hello = ClientHello(id=1, name="fuzz")
        else:
            hello = WorkerHello(id=1, worker_id=f"fuzz-{self.hellos}", capabilities=_CAPS)
        await link.ws.send(_frame(hello))
        self.hellos += 1
        async with asyncio.timeout(BOUND):
            reply = self._check(link, await link.ws.recv())
        assert reply.kind in ("welcome", "ack"), reply
        self.links[target] = link
        return link

    async def close(self) -> None:
        for link in self.links.values():
            await _close(link)
        self.links.clear()


_CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")


async def _close(link: _Link) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(BOUND):
            await link.ws.close()


# -- the test -----------------------------------------------------------------------------------


def test_random_and_mutated_frames_get_errors_or_clean_closes_and_a_job_still_succeeds(
    tmp_path, record_property
):
    with cluster(tmp_path, {"w1": ()}, peer_links=True) as c:
        fuzzer = Fuzzer(c.url, c.peer_addresses["w1"])
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:

            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(target=st.sampled_from(TARGETS), batch=payloads)
            def fuzz(target: str, batch: list[Payload]) -> None:
                runner.run(fuzzer.exchange(target, batch))

            started = time.monotonic()
            try:
                fuzz()
            finally:
                runner.run(fuzzer.close())
            took = time.monotonic() - started
        record_property("fuzz_messages_sent", fuzzer.sent)
        print(
            f"fuzz: {took:.1f}s, {fuzzer.examples} examples, {fuzzer.sent} messages sent "
            f"(+{fuzzer.sentinels} sentinels, {fuzzer.hellos} hellos); answers "
            f"{dict(fuzzer.answers)}; closes {dict(fuzzer.closes)}"
        )
        assert c.coordinator is not None and c.coordinator.poll() is None
        assert c.workers["w1"].poll() is None

        # A normal job, on the same coordinator and agent.
        with sz.connect(c.url, timeout=10 * UNIT) as client:
            for record in client.jobs(limit=1000):  # what the fuzz queued may never run
                if record["state"] in ("queued", "running"):
                    try:
                        client.job(record["id"]).cancel()
                    except sz.ClientError as exc:  # it ended in between
                        assert "already ended" in str(exc), exc
            wait_for(lambda: c.worker_state("w1") == "idle", 30 * UNIT, "w1 to be idle")
            torch.manual_seed(0)
            graph = Center().named("center") >> sz.TorchFilter(
                torch.nn.Linear(3, 1), lr=0.1, epochs=2
            ).named("lin")
            rng = np.random.default_rng(0)
            x = rng.normal(size=(32, 3)).astype(np.float32)
            y = x.sum(1, keepdims=True)
            fitted = client.submit(graph, x, y, strategy=sz.Local(worker="w1")).result(
                timeout=60 * UNIT
            )
        expected = graph.fit(x, y)
        torch.testing.assert_close(
            fitted.states["lin"]["weight"], expected.states["lin"]["weight"], rtol=0, atol=1e-6
        )
        logs = {name: (c.logs / f"{name}.log").read_text() for name in ("coordinator", "worker-w1")}
        for name, text in logs.items():
            at = text.find("Traceback")
            assert at < 0, f"{name} logged a traceback:\n{text[max(0, at - 1500) : at + 3000]}"
