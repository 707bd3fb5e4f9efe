"""Job files: a Python file that says what ``somatize submit FILE`` trains.

A job file is run with :func:`runpy.run_path`; it defines ``graph`` (a :class:`~somatize.Graph`)
and ``x``, and may define ``y``, ``strategy`` (default :class:`~somatize.Local`),
``validation`` (``(x_val, y_val)``, ``(x_val, None)`` or ``sz.WorkerData(name, split=...)``),
``name`` (what the job list calls the job), ``wait_for_workers`` (seconds) and ``sandbox``
(``"required"``: sandboxed workers only), each what
:meth:`somatize.remote.client.Client.submit` takes of that name. Any other name is the file's own,
except one that looks like a misspelt one of those that the file does not define (``stratgy``):
the file is refused, since the job would otherwise run without it (``Local`` on one worker for
a misspelt ``strategy``, and "succeed"); and validation data under a name of its own
(``x_val``) with no ``validation`` is warned about::

    import numpy as np, torch, somatize as sz

    x = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    graph = sz.Graph([sz.TorchFilter(torch.nn.Linear(8, 2), loss="cross_entropy", epochs=5)])
    strategy = sz.Local(tag="gpu")
    validation = (x[:32], y[:32])
"""

from __future__ import annotations

import runpy
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.messages import SandboxRequirement
from protocol.text.user_tracebacks import folded
from protocol.text.wording import did_you_mean
from somatize.errors import UsageError

if TYPE_CHECKING:
    from somatize.graph import Graph
    from somatize.options.strategies import Strategy

__all__ = ["NAMES", "JobFile", "load_job_file"]

NAMES = ("graph", "x", "y", "strategy", "validation", "name", "wait_for_workers", "sandbox")
"""What a job file may define for the job."""

_VALIDATION_PARTS = ("x_val", "y_val", "val_x", "val_y", "x_valid", "y_valid")
"""Names of validation data a job file may define without saying ``validation``."""


@dataclass
class JobFile:
    """What a job file defines for its job, and what looked wrong in it (``warnings``)."""

    graph: Graph
    x: Any
    strategy: Strategy
    y: Any = None
    validation: Any = None
    name: str | None = None
    wait_for_workers: float | None = None
    sandbox: SandboxRequirement = "any"
    warnings: list[str] = field(default_factory=list)


def load_job_file(path: str) -> JobFile:
    """Run a job file and return what it defines for its job.

    Raises:
        UsageError: no such file, the file raised, or it lacks a name or defines a wrong one.
    """
    from somatize.graph import Graph
    from somatize.options.strategies import Local, Strategy

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    namespace = _run(path, file)
    misspelt = _misspelt(path, namespace)
    if misspelt:
        raise UsageError("\n".join(misspelt))
    missing = [name for name in ("graph", "x") if name not in namespace]
    if missing:
        raise UsageError(
            f"{path} does not define {' and '.join(missing)}: a job file defines graph "
            f"(a somatize.Graph) and x, and may define {', '.join(NAMES[2:])}"
        )
    graph = namespace["graph"]
    if not isinstance(graph, Graph):
        raise UsageError(
            f"{path}: graph must be a somatize.Graph (a >> b, or somatize.Graph([f])), "
            f"not {type(graph).__name__}"
        )
    strategy = namespace.get("strategy", Local())
    if not isinstance(strategy, Strategy):
        raise UsageError(
            f"{path}: strategy must be a somatize strategy (somatize.Local...), "
            f"not {type(strategy).__name__}"
        )
    name = namespace.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise UsageError(f"{path}: name must be a non-empty string, not {name!r:.60}")
    wait = namespace.get("wait_for_workers")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)):
        raise UsageError(f"{path}: wait_for_workers must be seconds, not {wait!r:.60}")
    return JobFile(
        graph=graph,
        x=namespace["x"],
        strategy=strategy,
        y=namespace.get("y"),
        validation=namespace.get("validation"),
        name=name,
        wait_for_workers=None if wait is None else float(wait),
        sandbox=namespace.get("sandbox", "any"),  # checked by submit, as the SDK's own
        warnings=_warnings(path, namespace),
    )


def _run(path: str, file: Path) -> dict[str, Any]:
    """The names the job file defines, run as ``python FILE`` would run it.

    Raises:
        UsageError: the file raised.
    """
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)  # the file's own helper modules, as `python FILE` would see them
    try:
        return runpy.run_path(str(file), run_name="__somatize_job__")
    except Exception as exc:
        trace = folded(exc).rstrip()  # the file's frames; runpy's folded
        raise UsageError(f"{path} raised {type(exc).__name__} while loading:\n{trace}") from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def _misspelt(path: str, namespace: dict[str, Any]) -> list[str]:
    """A line for each name of ``namespace`` that is not read and is near one the job reads
    that the file does not define."""
    out = []
    for defined, value in namespace.items():
        if _own(defined, value) or defined in _VALIDATION_PARTS or len(defined) <= 3:
            continue
        near = did_you_mean(defined, [n for n in NAMES if n not in namespace])
        if near:
            out.append(
                f"{path} defines {defined!r}, which the job does not read{near}: the job would "
                "run without it; name it as the job reads it, or otherwise"
            )
    return out


def _warnings(path: str, namespace: dict[str, Any]) -> list[str]:
    """A line for each name of validation data with no ``validation``."""
    return [
        f"{path} defines {defined!r} and no validation: the job evaluates nothing (say "
        "validation = (x_val, y_val))"
        for defined in namespace
        if defined in _VALIDATION_PARTS and "validation" not in namespace
    ]


def _own(defined: str, value: Any) -> bool:
    """Whether a name is the job's, private or code (the file's imports and helpers)."""
    return defined in NAMES or defined.startswith("_") or _is_code(value)


def _is_code(value: Any) -> bool:
    """Modules, classes and functions: a job file's imports and helpers."""
    return isinstance(
        value, types.ModuleType | type | types.FunctionType | types.BuiltinFunctionType
    )
