"""The daemon's request handling, in-process: no subprocess, no event loop.

:class:`worker.daemon.main.Daemon` turns one request frame into one reply message, so every error
path of the protocol is checked here directly; ``test_daemon.py`` proves the same over real pipes.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch

import somatize as sz
from protocol.codec import decode, encode_frame
from protocol.daemon import (
    DaemonRequest,
    FitRequest,
    OkReply,
    reply_adapter,
    request_adapter,
    request_fields,
)
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from worker.daemon.main import Daemon


class Center:
    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Explode:
    def fit(self, x, y=None):
        return {}

    def forward(self, x, state):
        return self._deep(x)

    def _deep(self, x):
        raise ZeroDivisionError("exploded in forward")


class Opaque:
    """A filter whose state the codec cannot carry."""

    def fit(self, x, y=None):
        return {"thing": object()}

    def forward(self, x, state):
        return x


def _ask(daemon: Daemon, **message) -> dict:
    """One request through ``handle``, from a writable frame as the daemon reads them."""
    return daemon.handle(bytearray(encode_frame(message)))


def _error(reply: dict) -> dict:
    assert reply["ok"] is False, reply
    return reply["error"]


@pytest.fixture
def daemon() -> Daemon:
    d = Daemon()
    reply = _ask(
        d,
        id=1,
        cmd="load",
        filters={"center": dump_filter(Center()), "explode": dump_filter(Explode())},
    )
    assert reply == {"id": 1, "ok": True, "result": ["center", "explode"]}
    return d


# -- the request path ----------------------------------------------------------------------------


def test_every_command_has_one_handler_in_one_table():
    union = typing.get_args(DaemonRequest)[0]
    commands = {model.model_fields["cmd"].default for model in typing.get_args(union)}
    d = Daemon()
    assert set(d._handlers) == commands
    group = d.group_commands.handlers  # dist_* and pipe_*: the group commands' own
    assert group and all(d._handlers[cmd] == handler for cmd, handler in group.items())


def test_a_request_is_answered_with_its_id(daemon):
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    reply = _ask(daemon, id=41, cmd="fit", node_id="center", x=x)
    assert reply["id"] == 41 and reply["ok"] is True
    assert set(reply["result"]) == {
        "output",
        "states",
        "loss",
        "rows",
        "epoch_losses",
        "start_loss",
        "clipped",
        "history",
        "step_scores",
        "metrics",
    }
    np.testing.assert_array_equal(reply["result"]["states"]["center"]["mean"], [2.0, 3.0])
    assert _ask(daemon, id=42, cmd="ping") == {"id": 42, "ok": True, "result": None}


def test_bytes_that_are_not_a_frame_get_bad_frame_with_id_minus_one(daemon):
    error = _error(reply := daemon.handle(bytearray(b"\x05\x00\x00\x00nope")))
    assert reply["id"] == -1
    assert error["code"] == ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"id": 3, "cmd": "launch"}, "cmd"),
        ({"id": 3}, "cmd"),
        ({"id": 3, "cmd": "fit", "x": 1}, "node_id"),
        ({"id": 3, "cmd": "fit", "node_id": 7, "x": 1}, "node_id"),
        ({"id": 3, "cmd": "ping", "colour": "red"}, "colour"),
        ({"id": 3, "cmd": "batched_fit", "node_ids": ["a"], "x": 1, "batch_size": 0}, "batch_size"),
        ({"id": 3, "cmd": "composite_fit", "node_ids": [], "x": 1}, "node_ids"),
        ({"id": 3, "cmd": "load", "filters": {"a": "not bytes"}}, "filters.a"),
        ({"id": 3, "cmd": "apply_gradients", "gradients": {"a": 1}}, "gradients.a"),
    ],
)
def test_an_invalid_request_gets_bad_request_naming_the_field(daemon, message, field):
    reply = daemon.handle(bytearray(encode_frame(message)))
    error = _error(reply)
    assert reply["id"] == 3
    assert error["code"] == ErrorCode.BAD_REQUEST
    assert error["detail"]["field"] == field
    assert field in error["message"]


@pytest.mark.parametrize("message", [[1, 2], "ping", {"cmd": "ping"}, {"id": "7", "cmd": "ping"}])
def test_a_request_without_a_usable_id_is_answered_with_id_minus_one(daemon, message):
    reply = daemon.handle(bytearray(encode_frame(message)))
    assert reply["id"] == -1
    assert _error(reply)["code"] == ErrorCode.BAD_REQUEST


def test_an_engine_refusal_keeps_its_code(daemon):
    error = _error(_ask(daemon, id=5, cmd="forward", node_id="missing", x=[1.0]))
    assert error["code"] == ErrorCode.UNKNOWN_NODE
    error = _error(_ask(daemon, id=6, cmd="forward", node_id="center", x=np.ones(2)))
    assert error["code"] == ErrorCode.NOT_FITTED


def test_a_filter_that_raises_in_a_chain_is_named_with_its_traceback(daemon):
    x = np.ones((2, 2), dtype=np.float32)
    reply = _ask(daemon, id=9, cmd="composite_fit", node_ids=["center", "explode"], x=x)
    error = _error(reply)
    assert error["code"] == ErrorCode.FILTER_ERROR
    assert error["detail"]["node_id"] == "explode"
    assert error["detail"]["type"] == "ZeroDivisionError"
    assert error["detail"]["cmd"] == "composite_fit"
    assert "_deep" in error["detail"]["traceback"]
    assert "exploded in forward" in error["message"]


def test_a_torch_module_that_raises_is_blamed_on_its_node():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            raise RuntimeError("module failed")

    d = Daemon()
    filters = {"c": dump_filter(Center()), "net": dump_filter(sz.TorchFilter(Broken()))}
    _ask(d, id=1, cmd="load", filters=filters)
    x = np.ones((4, 2), dtype=np.float32)
    error = _error(_ask(d, id=2, cmd="batched_fit", node_ids=["c", "net"], x=x, y=x))
    assert error["detail"]["node_id"] == "net"
    assert "module failed" in error["message"]


def test_a_filter_that_cannot_be_unpickled_is_named_and_the_old_ones_stay(daemon):
    filters = {"good": dump_filter(Center()), "bad": b"\x80\x05not a pickle"}
    error = _error(_ask(daemon, id=2, cmd="load", filters=filters))
    assert error["code"] == ErrorCode.FILTER_ERROR
    assert error["detail"]["node_id"] == "bad"
    assert "traceback" in error["detail"]
    assert daemon.engine.nodes.node_ids == ["center", "explode"]


def test_a_filter_calling_sys_exit_is_an_error_not_an_exit():
    class Quitter:
        def fit(self, x, y=None):
            raise SystemExit(4)

    d = Daemon()
    _ask(d, id=1, cmd="load", filters={"q": dump_filter(Quitter())})
    error = _error(_ask(d, id=2, cmd="fit", node_id="q", x=[1.0]))
    assert error["code"] == ErrorCode.FILTER_ERROR
    assert error["detail"]["type"] == "SystemExit"


def test_a_result_the_codec_cannot_carry_becomes_an_error_reply():
    d = Daemon()
    _ask(d, id=1, cmd="load", filters={"o": dump_filter(Opaque())})
    reply = decode(
        bytearray(
            b"".join(
                d.respond(
                    bytearray(encode_frame({"id": 2, "cmd": "fit", "node_id": "o", "x": [1.0]}))
                )
            )
        )
    )
    assert reply["id"] == 2
    assert _error(reply)["code"] == ErrorCode.FILTER_ERROR
    assert "cannot be sent back" in reply["error"]["message"]


def test_shutdown_answers_then_stops(daemon):
    assert _ask(daemon, id=8, cmd="shutdown") == {"id": 8, "ok": True, "result": None}
    assert daemon.stopping


def test_decoded_tensors_reach_the_filter_as_writable_zero_copy_views():
    class Probe:
        def fit(self, x, y=None):
            x.add_(1)  # would fail (or warn) on a read-only buffer
            self.address = x.untyped_storage().data_ptr()
            return {}

        def forward(self, x, state):
            return x

    d = Daemon()
    _ask(d, id=1, cmd="load", filters={"p": dump_filter(Probe())})
    frame = bytearray(encode_frame({"id": 2, "cmd": "fit", "node_id": "p", "x": torch.zeros(64)}))
    assert d.handle(frame)["ok"] is True
    base = np.frombuffer(frame, np.uint8).ctypes.data
    assert base <= d.engine.nodes.filter("p").address < base + len(frame)


# -- messages -----------------------------------------------------------------------------------


def test_request_fields_is_shallow_so_tensors_are_not_copied():
    x = torch.ones(3)
    request = request_adapter.validate_python({"id": 1, "cmd": "fit", "node_id": "a", "x": x})
    assert isinstance(request, FitRequest)
    assert request.x is x
    fields = request_fields(request)
    assert fields["x"] is x
    assert fields == {"id": 1, "cmd": "fit", "node_id": "a", "x": x, "y": None}


def test_replies_are_told_apart_by_ok():
    assert isinstance(reply_adapter.validate_python({"id": 1, "ok": True, "result": 3}), OkReply)
    error = reply_adapter.validate_python(
        {"id": 1, "ok": False, "error": {"code": "timeout", "message": "late"}}
    )
    assert error.error.code == ErrorCode.TIMEOUT


def test_batched_fit_can_keep_its_output_on_the_worker():
    """A federated client's predictions on its private data must not travel back."""
    import numpy as np
    import torch

    import somatize as sz
    from protocol.codec import decode, encode_frame
    from protocol.filters import dump_filter
    from worker.daemon.main import Daemon

    daemon = Daemon()
    load = {
        "id": 1,
        "cmd": "load",
        "filters": {"lin": dump_filter(sz.TorchFilter(torch.nn.Linear(2, 1)))},
    }
    assert decode(b"".join(daemon.respond(bytearray(encode_frame(load)))))["ok"]
    x, y = np.ones((4, 2), np.float32), np.ones((4, 1), np.float32)
    for keep, expect_output in ((True, True), (False, False)):
        request = {
            "id": 2,
            "cmd": "batched_fit",
            "node_ids": ["lin"],
            "x": x,
            "y": y,
            "return_output": keep,
            "return_states": keep,
        }
        reply = decode(b"".join(daemon.respond(bytearray(encode_frame(request)))))
        assert reply["ok"], reply
        assert (reply["result"]["output"] is not None) is expect_output
        assert set(reply["result"]["states"]) == ({"lin"} if keep else set())
        assert reply["result"]["rows"] == 4
    # The states left out are the ones get_state reads afterwards.
    request = {"id": 3, "cmd": "get_state", "node_ids": ["lin"]}
    reply = decode(b"".join(daemon.respond(bytearray(encode_frame(request)))))
    assert set(reply["result"]["lin"]) == {"weight", "bias"}
