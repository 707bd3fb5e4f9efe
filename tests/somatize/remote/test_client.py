"""The client SDK and the ``somatize`` CLI without a real coordinator.

URL handling, argument parsing, job files, the "coordinator unreachable"
path, and the client's protocol logic against a small fake coordinator (a
:class:`~protocol.asyncio.channel.Channel` on a loopback WebSocket that answers from a script).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import websockets

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.chunking import chunk_messages
from protocol.codec import encode_frame
from protocol.errors import ErrorCode, ErrorInfo, RemoteError
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    ClientHello,
    Error,
    JobEvent,
    Result,
    Welcome,
)
from somatize.cli import curves, tables
from somatize.cli import main as cli
from somatize.cli.job_files import load_job_file
from somatize.remote.client import client_url
from somatize.remote.jobs import read_in_pieces
from tests.utils import UNIT

# -- URLs and arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("ws://127.0.0.1:8765", "ws://127.0.0.1:8765/client"),
        ("ws://127.0.0.1:8765/", "ws://127.0.0.1:8765/client"),
        ("127.0.0.1:8765", "ws://127.0.0.1:8765/client"),
        ("wss://example.org/somatize/client", "wss://example.org/somatize/client"),
    ],
)
def test_client_url(given, url):
    assert client_url(given) == url


@pytest.mark.parametrize(
    ("given", "text"),
    [("http://h:1", "starts with ws:// or wss://"), ("", "non-empty"), ("ws://h:x", "bad port")],
)
def test_client_url_refuses(given, text):
    with pytest.raises(ValueError, match=text):
        client_url(given)


def test_cli_arguments_and_their_environment_defaults(monkeypatch):
    monkeypatch.delenv("SOMATIZE_COORDINATOR", raising=False)
    monkeypatch.delenv("SOMATIZE_TOKEN", raising=False)
    args = cli._parser().parse_args(["submit", "job.py"])
    assert (args.file, args.no_wait, args.coordinator, args.token) == (
        "job.py",
        False,
        "ws://127.0.0.1:8765",
        None,
    )

    monkeypatch.setenv("SOMATIZE_COORDINATOR", "ws://elsewhere:1")
    monkeypatch.setenv("SOMATIZE_TOKEN", "s3cret")
    args = cli._parser().parse_args(["result", "j1", "--save", "out.pt"])
    assert (args.job_id, args.save, args.wait) == ("j1", "out.pt", 0.0)
    assert (args.coordinator, args.token) == ("ws://elsewhere:1", "s3cret")

    args = cli._parser().parse_args(
        ["submit", "--no-wait", "job.py", "--coordinator", "ws://h:2", "--token", "t"]
    )
    assert (args.no_wait, args.coordinator, args.token) == (True, "ws://h:2", "t")
    assert cli._parser().parse_args(["jobs", "--limit", "3"]).limit == 3
    assert cli._parser().parse_args(["status"]).command == "status"
    assert cli._parser().parse_args(["demo"]).epochs == 10


def test_the_token_file_is_read_once_and_refused_when_others_can_read_it(tmp_path, capsys):
    token = tmp_path / "client.token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    args = cli._parser().parse_args(["status", "--token-file", str(token), "--token", "argv"])
    assert cli._token(args) == "s3cret"  # the file wins over the command line
    token.chmod(0o640)
    assert cli.main(["status", "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert f"the token file {token} is open to others (mode 0640): chmod 600 it" in err


def test_tables_show_ids_and_tags_as_they_are_never_as_markup_or_escape_sequences():
    from rich.console import Console

    workers = [
        {"id": "w\x1b[2J\x1b]0;pwned\x07", "tags": ["[bold red]boom[/]"], "state": "idle"},
    ]
    console = Console(record=True, width=200, color_system=None)
    console.print(tables.workers_table(workers))
    shown = console.export_text()
    assert "\x1b" not in shown and "\\x1b[2J\\x1b]0;pwned\\x07" in shown
    assert "[bold red]boom[/]" in shown


@pytest.mark.parametrize(
    "argv",
    [["jobs", "--limit", "0"], ["result"], ["submit"], ["nope"], ["status", "--timeout", "0"]],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", [["status"], ["jobs"], ["result", "j1"]])
def test_cli_coordinator_unreachable_is_one_line_and_exit_2(command, capsys):
    url = f"ws://127.0.0.1:{_closed_port()}"
    assert cli.main([*command, "--coordinator", url, "--timeout", str(5 * UNIT)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert f"cannot reach the coordinator at {url}/client" in lines[0]
    assert "connection refused" in lines[0]
    assert "Traceback" not in captured.err


def test_connect_to_a_closed_port_raises_connection_failed():
    port = _closed_port()
    with pytest.raises(sz.ConnectionFailed, match="connection refused") as exc:
        sz.connect(f"ws://127.0.0.1:{port}", timeout=5 * UNIT)
    assert isinstance(exc.value, ConnectionError)


def test_connect_checks_its_arguments():
    with pytest.raises(ValueError, match="timeout must be a positive"):
        sz.connect("ws://127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="token must be a non-empty string"):
        sz.connect("ws://127.0.0.1:1", token="")


# -- job files ---------------------------------------------------------------------------------

JOB_FILE = """
import numpy as np
import torch
import somatize as sz

class Double(sz.Filter):
    def forward(self, x, state):
        return x * 2

x = np.ones((4, 2), dtype=np.float32)
{extra}
"""


def _job_file(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(JOB_FILE.format(extra=extra))
    return str(path)


def test_submit_a_file_without_graph_is_a_clear_usage_error(tmp_path, capsys):
    path = _job_file(tmp_path, "")
    # The file is checked before connecting: no coordinator is needed for this error.
    assert cli.main(["submit", path, "--coordinator", f"ws://127.0.0.1:{_closed_port()}"]) == 2
    err = capsys.readouterr().err
    assert f"{path} does not define graph:" in err
    assert "a job file defines graph (a somatize.Graph) and x" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ("graph = Double()", "graph must be a somatize.Graph"),
        ("graph = sz.Graph([Double()])\ndel x", "does not define x"),
        ("graph = sz.Graph([Double()])\nstrategy = 'local'", "strategy must be a somatize"),
        ("raise RuntimeError('broken job file')", "raised RuntimeError while loading"),
    ],
)
def test_job_file_errors(tmp_path, extra, text):
    with pytest.raises(cli.UsageError, match=text):
        load_job_file(_job_file(tmp_path, extra))


def test_job_file_defaults(tmp_path):
    spec = load_job_file(_job_file(tmp_path, "graph = sz.Graph([Double()])"))
    assert spec.graph.node_ids == ["double"]
    assert spec.x.shape == (4, 2) and spec.y is None
    assert spec.strategy == sz.Local()
    assert spec.validation is None and spec.name is None and spec.warnings == []
    with pytest.raises(cli.UsageError, match="no such file"):
        load_job_file(str(tmp_path / "missing.py"))


def test_a_job_file_says_validation_and_name_and_is_refused_what_it_misspells(tmp_path):
    extra = (
        "graph = sz.Graph([Double()])\n"
        "validation = (x[:2], None)\n"
        "name = 'doubling'\n"
        "wait_for_workers = 5\n"
        "y_val = x[:2]\n"
        "helper = 3\n"
        "strategies = [sz.Local()]\n"  # near 'strategy', but the file defines that too
        "strategy = strategies[0]\n"
    )
    spec = load_job_file(_job_file(tmp_path, extra))
    assert spec.name == "doubling" and spec.wait_for_workers == 5.0
    assert spec.validation[0].shape == (2, 2) and spec.validation[1] is None
    assert spec.warnings == []  # y_val sits beside validation; helper is the file's own
    misspelt = "graph = sz.Graph([Double()])\nstratgey = sz.DataParallel(2)\nvalidaton = None\n"
    with pytest.raises(cli.UsageError) as refused:
        load_job_file(_job_file(tmp_path, misspelt))
    assert str(refused.value).splitlines() == [
        f"{tmp_path / 'job.py'} defines {name!r}, which the job does not read (did you mean "
        f"{meant!r}?): the job would run without it; name it as the job reads it, or otherwise"
        for name, meant in (("stratgey", "strategy"), ("validaton", "validation"))
    ]
    alone = load_job_file(_job_file(tmp_path, "graph = sz.Graph([Double()])\nx_val = x"))
    assert alone.warnings == [
        f"{tmp_path / 'job.py'} defines 'x_val' and no validation: the job evaluates nothing "
        "(say validation = (x_val, y_val))"
    ]
    with pytest.raises(cli.UsageError, match="name must be a non-empty string"):
        load_job_file(_job_file(tmp_path, "graph = sz.Graph([Double()])\nname = 3"))


def test_status_shows_each_workers_device():
    from rich.console import Console

    h200 = {"device": "cuda:0", "device_name": "NVIDIA H200", "device_memory_bytes": 150 << 30}
    workers = [
        {"id": "w1", "tags": ["a"], "state": "idle", "capabilities": {"device": "cpu"}},
        {"id": "w2", "tags": [], "state": "busy", "job_id": "j1", "capabilities": h200},
        {"id": "w3", "state": "offline"},  # an older coordinator: no capabilities
    ]
    console = Console(width=160, record=True)
    console.print(tables.workers_table(workers))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "heartbeat" in line)
    assert [c.strip() for c in header.strip("│┃ ").split("┃")][:4] == [
        "id",
        "tags",
        "state",
        "device",
    ]

    def device_of(worker_id: str) -> str:
        row = next(line for line in lines if line.startswith(f"│ {worker_id} "))
        return row.split("│")[4].strip()

    assert device_of("w1") == "cpu"
    assert device_of("w2") == "cuda:0 NVIDIA H200 150.0 GiB"
    assert device_of("w3") == "cpu"
    assert tables.device_text({"device": "mps", "device_name": "Apple M2"}) == "mps Apple M2"


def test_the_placed_event_names_each_workers_device():
    data = {"workers": ["w1", "w2"], "devices": ["cuda:0", "cpu"]}
    assert tables.placed_text(data) == "placed on w1 (cuda:0), w2 (cpu)"
    assert tables.placed_text({"workers": ["w1"]}) == "placed on w1"  # an older coordinator
    assert tables.placed_text({}) == "placed on ?"
    torch_dp = {"workers": ["w1", "w2"], "collective": "torch", "backend": "gloo"}
    assert tables.placed_text(torch_dp) == "placed on w1, w2; gradients by torch.distributed (gloo)"
    star = {"workers": ["w1"], "collective": "coordinator", "collective_reason": "asked for"}
    assert tables.placed_text(star) == "placed on w1; gradients through the coordinator: asked for"


def test_state_and_progress_descriptions():
    state = {"w": torch.zeros(2, 3), "b": np.zeros(3, dtype=np.float32), "n": 3, "l": [None]}
    assert list(tables.describe_state(state)) == [
        ("w", "(2, 3)", "float32"),  # numpy's and torch's named one way (issue 18)
        ("b", "(3,)", "float32"),
        ("n", "", "int 3"),
        ("l[0]", "", "NoneType None"),
    ]
    # 6 + 3 numbers of 4 bytes each, in one line; the plain values are no tensors.
    summary = tables.states_summary({"mlp": state, "center": {"mean": np.zeros(256)}})
    assert summary == "states of 2 nodes ['mlp', 'center']: 3 tensors, 265 numbers (2.0 kB)"
    assert tables.states_summary({"f": {}}) == "states of 1 node ['f']: no tensors"
    step = {"phase": "training", "epoch": 2, "epochs": 5, "step": 7, "loss": 0.5}
    assert tables.progress_text(step) == "epoch 2/5 · step 7 · loss 0.5 (last step)"
    trained = {"phase": "trained", "epochs": 3, "epoch_losses": [1.0], "nodes": 2}
    assert tables.progress_text(trained) == "trained 3 epochs · loss 1 (last epoch mean)"
    lost = {"worker": "w2", "code": "worker_lost", "replica": 1, "step": 5}
    assert tables.replica_text("worker_lost", lost) == (
        "lost worker w2 (worker_lost); waiting for a replacement"
    )
    replaced = {"worker": "w3", "lost": "w2", "replica": 1}
    assert tables.replica_text("worker_replaced", replaced) == "worker w3 replaces w2"
    record = {"created": 10.0, "started": 12.0, "finished": 15.5}
    assert tables.duration_text(record, now=100.0) == "3.5 s"
    assert (
        tables.duration_text({"created": 10.0, "started": None, "finished": None}, 20)
        == "waiting 10 s"
    )


# -- the client against a fake coordinator -----------------------------------------------------

Script = Callable[[Channel, Any], Any]


class FakeCoordinator:
    """A loopback WebSocket server in a thread of its own; ``script(channel, message)`` answers
    each client request (return a reply, raise :class:`RemoteError`, or stream with
    ``channel.reply``)."""

    def __init__(self, script: Script, hello: Callable[[Any], Any] | None = None) -> None:
        self.script = script
        self.hello = hello or (
            lambda m: Welcome(heartbeat_interval=1, heartbeat_timeout=5, server="fake")
        )
        self.headers: list[Any] = []
        self.requests: list[Any] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10 * UNIT)
        self.url = f"ws://127.0.0.1:{self.port}"

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()

        def record(connection, request):
            self.headers.append(request.headers)

        async with websockets.serve(
            self._serve,
            "127.0.0.1",
            0,
            compression=None,
            max_size=4 * CHUNK_BYTES,
            process_request=record,
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    async def _serve(self, ws) -> None:
        channel = Channel(ws, "fake client link")
        hello = await channel.receive(first=True)
        assert isinstance(hello, ClientHello)
        reply = self.hello(hello)
        if reply is None:
            await ws.close()
            return
        await channel.reply(hello, reply)

        async def handle(message):
            self.requests.append(message)
            result = self.script(channel, message)
            return await result if asyncio.iscoroutine(result) else result

        channel.handler = handle
        await channel.run()

    def close(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10 * UNIT)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeCoordinator]]:
    made: list[FakeCoordinator] = []

    def make(script: Script, hello: Callable[[Any], Any] | None = None) -> FakeCoordinator:
        made.append(FakeCoordinator(script, hello))
        return made[-1]

    yield make
    for server in made:
        server.close()


def _graph() -> sz.Graph:
    torch.manual_seed(0)
    return sz.Graph([sz.TorchFilter(torch.nn.Linear(2, 1), epochs=1).named("lin")])


STATES = {"lin": {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}}


def _job_script(end: str, end_data: dict[str, Any]) -> Script:
    async def script(channel: Channel, message: Any) -> Any:
        if message.kind == "submit":
            return Result(result={"job_id": "j1"})
        if message.kind == "watch":
            events = [
                ("queued", {}),
                ("placed", {"workers": ["w1"]}),
                ("progress", {"epoch": 1, "epochs": 1, "loss": 0.25}),
                (end, end_data),
            ]
            for seq, (event, data) in enumerate(events, 1):
                if seq > message.after_seq:
                    await channel.reply(
                        message, JobEvent(job_id="j1", seq=seq, time=seq, event=event, data=data)
                    )
            return Ack()
        if message.kind == "get_result":
            if end != "succeeded":
                raise RemoteError(ErrorInfo(code=end_data["code"], message="job j1 ended"))
            return Result(result={"job_id": "j1", "states": STATES, "record": {}})
        if message.kind == "cancel":
            return Ack()
        raise RemoteError(ErrorInfo(code=ErrorCode.BAD_REQUEST, message=message.kind))

    return script


def test_submit_events_and_result(fake):
    server = fake(_job_script("succeeded", {}))
    graph = _graph()
    x, y = np.ones((4, 2), dtype=np.float32), np.zeros(4, dtype=np.float32)
    with sz.connect(server.url, token="s3cret", timeout=10 * UNIT) as client:
        assert client.server == "fake"
        job = client.submit(graph, x, y, strategy=sz.Local(tag="cpu"))
        assert job.id == "j1"
        events = list(job.events(timeout=10 * UNIT))
        assert [e.event for e in events] == ["queued", "placed", "progress", "succeeded"]
        assert [e.seq for e in events] == [1, 2, 3, 4] and events[-1].terminal
        assert [e.event for e in job.events(after_seq=2)] == ["progress", "succeeded"]
        fitted = job.result(timeout=10 * UNIT)
        assert isinstance(fitted, sz.FittedGraph) and fitted.graph is graph
        torch.testing.assert_close(fitted.states["lin"]["weight"], torch.ones(1, 2))
        assert set(job.states(timeout=0)) == {"lin"}

        by_id = client.job("j1")
        with pytest.raises(sz.GraphError, match=r"use job.states\(\)"):
            by_id.result()
        assert isinstance(by_id.result(graph=graph), sz.FittedGraph)

    submit = server.requests[0]
    assert submit.graph.node_ids == ["lin"] and set(submit.graph.filters) == {"lin"}
    assert submit.strategy.model_dump() == {"name": "local", "options": {"tag": "cpu"}}
    np.testing.assert_array_equal(submit.x, x)
    assert server.headers[0]["Authorization"] == "Bearer s3cret"


def test_a_failed_job_raises_job_failed_with_the_traceback(fake):
    detail = {"traceback": "Traceback (most recent call last):\n  ValueError: boom"}
    server = fake(
        _job_script("failed", {"code": "filter_error", "message": "boom", "detail": detail})
    )
    with sz.connect(server.url, timeout=10 * UNIT) as client:
        job = client.submit(_graph(), np.ones((4, 2), dtype=np.float32))
        for timeout in (10 * UNIT, 0):
            with pytest.raises(sz.JobFailed) as exc:
                job.result(timeout=timeout)
            assert (exc.value.job_id, exc.value.code, exc.value.message) == (
                "j1",
                "filter_error",
                "boom",
            )
            assert "ValueError: boom" in exc.value.traceback
            assert str(exc.value) == "job j1 failed: [filter_error] boom"


def test_a_cancelled_job_raises_job_failed_cancelled(fake):
    data = {"code": "cancelled", "message": "cancelled by the client", "detail": {}}
    server = fake(_job_script("cancelled", data))
    with sz.connect(server.url, timeout=10 * UNIT) as client:
        job = client.job("j1")
        job.cancel()
        with pytest.raises(sz.JobFailed, match="job j1 was cancelled") as exc:
            job.states()
        assert exc.value.code == "cancelled"


def test_a_refused_hello_names_the_reason(fake):
    def refuse(hello):
        return Error(error=ErrorInfo(code=ErrorCode.UNAUTHORIZED, message="wrong token"))

    server = fake(lambda channel, message: None, hello=refuse)
    with pytest.raises(sz.ConnectionFailed, match=r"refused the connection: \[unauthorized\]"):
        sz.connect(server.url, timeout=10 * UNIT)


def test_a_version_mismatch_names_both_versions(fake):
    server = fake(
        lambda channel, message: None,
        hello=lambda m: Welcome(v=99, heartbeat_interval=1, heartbeat_timeout=5, server="future"),
    )
    with pytest.raises(sz.ConnectionFailed, match="peer speaks 99, this side speaks 1"):
        sz.connect(server.url, timeout=10 * UNIT)


def test_a_request_without_an_answer_times_out_clearly(fake):
    async def never(channel, message):
        await asyncio.sleep(3600)

    server = fake(never)
    with (
        sz.connect(server.url, timeout=0.5 * UNIT) as client,
        pytest.raises(TimeoutError, match="did not answer 'status' within"),
    ):
        client.status()


def test_a_dead_connection_raises_instead_of_hanging(fake):
    async def hang_up(channel, message):
        if message.kind == "watch":
            await channel.reply(
                message, JobEvent(job_id="j1", seq=1, time=1.0, event="queued", data={})
            )
        await channel.close(1011, "gone")

    server = fake(hang_up)
    with sz.connect(server.url, timeout=10 * UNIT) as client:
        events = client.job("j1").events()
        assert next(events).event == "queued"
        with pytest.raises(sz.ConnectionFailed, match="lost the connection"):
            next(events)
        with pytest.raises(sz.ConnectionFailed):
            client.jobs()


def test_an_unknown_job_is_a_client_error(fake):
    def script(channel, message):
        raise RemoteError(ErrorInfo(code=ErrorCode.UNKNOWN_JOB, message="no job 'nope'"))

    server = fake(script)
    with sz.connect(server.url, timeout=10 * UNIT) as client:
        with pytest.raises(sz.ClientError, match="no job 'nope'") as exc:
            client.job("nope").states(timeout=0)
        assert exc.value.code == "unknown_job"
        with pytest.raises(sz.ClientError, match="no job"):
            list(client.job("nope").events())


def test_submit_takes_a_graph_and_a_strategy(fake):
    server = fake(lambda channel, message: None)
    with sz.connect(server.url, timeout=10 * UNIT) as client:
        with pytest.raises(TypeError, match=r"submit takes a somatize\.Graph"):
            client.submit(sz.Filter(), np.ones(2))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="strategy must be a somatize strategy"):
            client.submit(_graph(), np.ones(2), strategy="local")  # type: ignore[arg-type]
    with pytest.raises(sz.ClientError, match="closed"):
        client.status()


def test_a_large_reply_arriving_slowly_is_waited_for_but_a_stall_times_out(fake):
    big = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)  # 3 MiB: four chunks

    async def slow(channel, message):
        reply = Result(id=channel.next_id(), reply_to=message.id, result={"states": {"b": big}})
        frame = encode_frame(reply.model_dump())
        chunks = list(chunk_messages([frame], stream=message.id))
        if message.kind == "status":  # stall after the first chunk
            chunks = chunks[:1]
        for chunk in chunks:
            await channel.transport.send(chunk)
            await asyncio.sleep(0.3 * UNIT)  # each chunk inside the client's 0.5-unit timeout
        await asyncio.sleep(3600)

    server = fake(slow)
    with sz.connect(server.url, timeout=0.5 * UNIT) as client:
        started = time.monotonic()
        states = client.job("j1").states(timeout=0)
        assert time.monotonic() - started > 0.5 * UNIT  # longer than one timeout, yet waited
        torch.testing.assert_close(states["b"], big)
        with pytest.raises(TimeoutError, match="did not answer 'status'"):
            client.status()


def test_the_loss_curve_has_a_point_for_every_step_of_a_chunked_progress_event():
    def progress(**data):
        return sz.JobEventInfo(seq=1, time=0.0, event="progress", data=data)

    events = [
        progress(step=1, loss=2.0, losses=[2.0]),
        progress(step=4, loss=1.0, losses=[1.5, 1.2, 1.0]),
        progress(step=5, loss=0.9),  # a step of its own, as the coordinator collective sends
    ]
    assert curves.loss_curve(events) == [(1, 2.0), (2, 1.5), (3, 1.2), (4, 1.0), (5, 0.9)]


def test_a_federated_loss_curve_counts_rounds_on_whole_number_ticks():
    """Issue 18: the FedAvg plot's x-axis said "step" and had ticks at 1.5."""

    def progress(**data):
        return sz.JobEventInfo(seq=1, time=0.0, event="progress", data=data)

    rounds = [progress(phase="round", round=r, rounds=3, loss=1.0 / r) for r in (1, 2, 3)]
    steps = [progress(phase="training", step=1, loss=1.0)]
    trained = [progress(phase="trained", epoch_losses=[1.0, 0.5])]
    assert curves.curve_unit(rounds) == "round" and curves.curve_unit(steps) == "step"
    assert curves.curve_unit(trained) == "epoch"

    figure = curves.loss_figure(curves.loss_curve(rounds), "job r", curves.curve_unit(rounds))
    try:
        figure.canvas.draw()
        axes = figure.axes[0]
        assert axes.get_xlabel() == "round"
        ticks = [t for t in axes.get_xticks() if 1 <= t <= 3]
        assert ticks == [1.0, 2.0, 3.0]  # no 1.5, 2.5
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_a_file_given_in_pieces_is_read_whole_and_a_wrong_piece_is_refused():
    data = bytes(range(256)) * 3

    def pieces_of(most: int, extra: bytes = b"") -> Callable[[int, int], Result]:
        def ask(offset: int, length: int) -> Result:
            assert length == len(data) - offset  # (all that is left: under MAX_READ_BYTES)
            return Result(result={"data": data[offset : offset + min(length, most)] + extra})

        return ask

    assert read_in_pieces(pieces_of(100), len(data), "get_result", "f") == data  # 8 pieces
    assert read_in_pieces(pieces_of(100), 0, "get_result", "f") == b""
    for ask, said in (
        (pieces_of(0), "at 0 of 768 bytes as 0"),  # none: it ended early
        (pieces_of(len(data), b"x"), "as 769, asked for 768"),
        (lambda o, n: Result(result={"data": "text"}), "as 'text'"),
        (lambda o, n: Result(result={}), "has no 'data'"),
    ):
        with pytest.raises(sz.ClientError, match=said):
            read_in_pieces(ask, len(data), "get_result", "f")
    with pytest.raises(sz.ClientError, match="gives f -1 bytes"):
        read_in_pieces(pieces_of(100), -1, "get_result", "f")


def test_a_sharded_checkpoints_file_that_comes_other_than_saved_is_refused(fake):
    """The coordinator gives a file in pieces without hashing it: the client checks the
    digest the checkpoint lists once it has them all."""
    saved = hashlib.sha256(b"good").hexdigest()

    def script(channel: Channel, message: Any) -> Any:
        assert message.kind == "get_checkpoint"
        if message.file is None:
            files = {".metadata": {"bytes": 4, "sha256": saved}}
            shards = {"names": [".metadata"], "files": files, "rest": {}, "plain": {}}
            return Result(result={"seq": 1, "position": {"step": 2}, "shards": shards})
        assert (message.seq, message.offset, message.length) == (1, 0, 4)
        return Result(result={"seq": 1, "file": ".metadata", "offset": 0, "data": b"bad!"})

    server = fake(script)
    with (
        sz.connect(server.url, timeout=10 * UNIT) as client,
        pytest.raises(sz.ClientError, match=r"file \.metadata came other than it was saved"),
    ):
        client.job("j1").checkpoint()
