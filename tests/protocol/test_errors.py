"""protocol.errors: one exception tree, drawn in full in its docstring, and nothing outside it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import protocol
from protocol import errors
from protocol.errors import ErrorCode, ProtocolError, RemoteError, RequestRefused


def _exceptions() -> list[type[BaseException]]:
    return [
        value
        for value in vars(errors).values()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    ]


def test_every_exception_of_the_module_is_drawn_in_its_tree_under_the_root():
    drawn = errors.__doc__ or ""
    for exc in _exceptions():
        assert exc is ProtocolError or issubclass(exc, ProtocolError), exc
        assert f" {exc.__name__} " in drawn or f"    {exc.__name__}" in drawn, exc.__name__


def test_no_other_protocol_module_defines_an_exception():
    root = Path(protocol.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any(b.endswith(("Error", "Exception")) for b in bases), (path, node.name)


def test_a_refusal_and_the_peers_error_carry_the_same_info_but_are_told_apart():
    refused = RequestRefused.of(ErrorCode.BUSY, "later", limit=3)
    assert refused.info.detail == {"limit": 3} and refused.code == ErrorCode.BUSY
    assert not isinstance(refused, RemoteError)
    assert not isinstance(RemoteError(refused.info), RequestRefused)
