"""Daemon commands parsed into their typed models on the worker side, with no daemon."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.daemon import FitRequest, LoadRequest, StageRequest
from protocol.errors import ErrorCode, RequestRefused
from worker.daemon.requests import parse_command, parse_request


def test_a_command_without_an_id_becomes_its_model_and_keeps_its_tensors():
    x = np.ones((3, 2), dtype=np.float32)
    request = parse_command({"cmd": "fit", "node_id": "a", "x": x})
    assert isinstance(request, FitRequest)
    assert request.x is x  # never copied: the codec decoded it zero-copy
    assert isinstance(parse_command({"cmd": "load", "filters": {"a": b"\x80"}}), LoadRequest)
    stage = parse_command({"cmd": "stage", "name": "train", "dataset": "local"})
    assert isinstance(stage, StageRequest) and stage.dataset == "local"


def test_an_id_given_with_a_command_is_replaced():
    assert parse_command({"cmd": "ping", "id": "not an int"}).id == 0


@pytest.mark.parametrize(
    ("command", "field"),
    [
        ({"cmd": "launch"}, "cmd"),
        ({}, "cmd"),
        ({"cmd": "fit", "node_id": ["not", "a", "string"], "x": 1}, "node_id"),
        ({"cmd": "ping", "colour": "red"}, "colour"),
    ],
)
def test_an_invalid_command_is_refused_naming_the_field(command, field):
    with pytest.raises(RequestRefused) as info:
        parse_command(command)
    assert info.value.info.code == ErrorCode.BAD_REQUEST
    assert info.value.info.detail["field"] == field
    assert info.value.info.message.startswith(f"invalid request: {field}: ")


def test_a_request_without_its_id_is_refused_where_the_daemon_reads_it():
    with pytest.raises(RequestRefused) as info:
        parse_request({"cmd": "ping"})
    assert info.value.info.detail["field"] == "id"
