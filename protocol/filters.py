"""The one pair of functions that (un)pickles user filters.

User filters travel as cloudpickle bytes: opaque to the coordinator (which never calls
:func:`load_filter`) and opened only inside the filter daemon or the user's own process. Data never
goes through here: tensors, states and gradients use :mod:`protocol.codec`.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import cloudpickle

from protocol.code_owners import is_user_module


def _submodule_classes(value: Any) -> set[str]:
    """Modules of the classes inside a ``torch.nn.Module`` (duck-typed: anything with
    ``modules()``), so a user's layer class is shipped with the model that uses it."""
    modules = getattr(value, "modules", None)
    if isinstance(value, type) or not callable(modules):
        return set()
    with contextlib.suppress(TypeError):
        return {type(m).__module__ for m in modules()}
    return set()


def _referenced_modules(obj: Any) -> set[str]:
    """Names of the modules defining ``obj``'s class and the classes/functions it holds."""
    names = {type(obj).__module__} | _submodule_classes(obj)
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, types.FunctionType | type):
            names.add(value.__module__)
        else:
            names.add(type(value).__module__)
            names |= _submodule_classes(value)
    return names


def dump_filter(obj: Any) -> bytes:
    """Pickle a filter so that a process without the user's source files can load it.

    Modules of the user's own (classes and functions defined in a script or a test file) are
    pickled by value; installed packages, the standard library and somatize itself by reference.
    """
    for name in _referenced_modules(obj):
        if is_user_module(name):
            cloudpickle.register_pickle_by_value(sys.modules[name])
    try:
        return bytes(cloudpickle.dumps(obj, protocol=5))
    finally:
        for name in _referenced_modules(obj):
            if is_user_module(name):
                cloudpickle.unregister_pickle_by_value(sys.modules[name])


def load_filter(data: bytes) -> Any:
    """Unpickle a filter made by :func:`dump_filter`. Runs user code: filter daemon only."""
    return cloudpickle.loads(data)
