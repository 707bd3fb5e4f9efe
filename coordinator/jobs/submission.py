"""What a submitted job is, or why it is refused: its strategy, inputs and placement.

Checked in a worker thread (:meth:`coordinator.jobs.manager.JobManager.submit`): linear in the
graph's size, nothing here touches the event loop or the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from coordinator.context import Target, WorkerIdentity
from coordinator.errors import StrategyOptionsError
from coordinator.strategies import JobInputs, Placement, Strategy, strategy_from_spec
from coordinator.workers.registry import WorkerRecord
from protocol.errors import ErrorCode, ErrorInfo, RequestRefused
from protocol.messages import SANDBOXES, NodeInfo, Submit
from protocol.options.devices import device_fits
from protocol.options.training import TrainingOptions
from protocol.rules.rows import (
    batch_problem,
    inline_data_problem,
    model_loss_with_labels,
    rows_of,
    step_not_alone,
)
from protocol.text.wording import capped, did_you_mean, listed

__all__ = [
    "check_targets",
    "check_workers",
    "job_inputs",
    "no_workers_after_wait",
    "placement_of",
    "rows_of",
    "summary_of",
    "unequal_stage_rows",
    "unlabelled",
    "vetted",
]


def vetted(msg: Submit) -> tuple[Strategy, JobInputs, Placement]:
    """The strategy, inputs and placement of a submitted job, or why it is refused (checked in
    a worker thread: see :meth:`JobManager.submit`).

    Raises:
        RequestRefused: ``BAD_REQUEST`` naming what is wrong.
    """
    try:
        strategy = strategy_from_spec(msg.strategy.name, msg.strategy.options)
    except StrategyOptionsError as exc:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, str(exc)) from exc
    missing = [n for n in msg.graph.node_ids if n not in msg.graph.filters]
    if missing or len(msg.graph.filters) != len(msg.graph.node_ids):
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            "graph.filters must hold exactly the nodes of graph.node_ids; missing "
            f"{listed(missing)}",
        )
    if msg.loader is not None and msg.dataset is None:
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST, "a loader opens a worker's dataset: name the dataset too"
        )
    if (msg.x is None) == (msg.dataset is None):
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            "a job trains on data it sends (x, y) or on the workers' own dataset, "
            "exactly one of the two",
        )
    inputs = job_inputs(msg)
    # What graph.fit would refuse of the data, refused now in its words (not on a worker).
    why = (
        None
        if msg.dataset is not None
        else inline_data_problem(
            inputs.node_ids, set(inputs.differentiable()), msg.x, msg.y, set(inputs.labelled())
        )
    )
    why = why or lone_steps_problem(inputs) or labels_unused_problem(inputs)
    if why is not None:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, why)
    check_validation(msg, inputs)
    why = steps_limits_problem(strategy.name, inputs)
    if why is not None:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, why)
    try:
        strategy.validate(inputs)
    except StrategyOptionsError as exc:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, str(exc)) from exc
    return strategy, inputs, placement_of(strategy, inputs)


def job_inputs(msg: Submit) -> JobInputs:
    """What a job of ``msg`` trains: its filters in graph order, its data and what the client
    declared of each node (each a reference to ``msg``'s own: no copy). ``msg``'s graph holds
    a filter for each node (:func:`vetted` checked it)."""
    return JobInputs(
        msg.graph.node_ids,
        {n: msg.graph.filters[n] for n in msg.graph.node_ids},
        msg.x,
        msg.y,
        dict(msg.graph.nodes),
        msg.dataset,
        msg.loader,
        x_val=msg.x_val,
        y_val=msg.y_val,
        val_split=msg.val_split,
        sandboxed=msg.sandbox == "required",
    )


def lone_steps_problem(inputs: JobInputs) -> str | None:
    """Why a node with a ``step`` function cannot train where it stands: a TorchFilter right
    before or after it, which would train with it as one model (the engine refuses it in the
    same words); ``None`` when every such node stands alone."""
    ids, torch_nodes = inputs.node_ids, set(inputs.differentiable())
    for k, node_id in enumerate(ids):
        if not inputs.nodes.get(node_id, NodeInfo()).step:
            continue
        joined = [n for n in (ids[k - 1] if k else None, *ids[k + 1 : k + 2]) if n in torch_nodes]
        if joined:
            return step_not_alone(node_id, joined)
    return None


def labels_unused_problem(inputs: JobInputs) -> str | None:
    """Why labels ``y`` sent with a job cannot be used: its TorchFilters' last one computes its
    own loss from the batch (``loss="model"``: no labels, no step function); ``None`` when
    they can."""
    torch_nodes = inputs.differentiable()
    if inputs.y is None or not torch_nodes:
        return None
    info = inputs.nodes.get(torch_nodes[-1], NodeInfo())
    return None if info.labels or info.step else model_loss_with_labels(torch_nodes[-1])


def steps_limits_problem(strategy: str, inputs: JobInputs) -> str | None:
    """Why a TorchFilter's ``max_steps`` or ``validate_every`` cannot be honoured by
    ``strategy``; ``None`` when the job asks for neither where it cannot have it.

    Local (``graph.fit``'s loop on a worker) and DataParallel honour both; DiLoCo stops after
    ``max_steps`` but evaluates only where its replicas hold the global model (an epoch's end);
    the federated strategies count rounds, not steps; ModelParallel does neither yet.
    """
    for node_id in inputs.differentiable():
        training = inputs.nodes.get(node_id, NodeInfo()).training or TrainingOptions()
        if training.max_steps is not None and strategy not in {"local", "data_parallel", "diloco"}:
            return f"node {node_id!r} has max_steps={training.max_steps}: " + _NO_MAX_STEPS.get(
                strategy, f"{strategy} does not honour it yet (Local and DataParallel do)"
            )
        if training.validate_every is not None and strategy not in VALIDATE_EVERY:
            return f"node {node_id!r} has validate_every={training.validate_every}: " + (
                _NO_VALIDATE_EVERY.get(
                    strategy,
                    f"{strategy} validates at each epoch's (round's) end only; Local and "
                    "DataParallel validate between them",
                )
            )
    return None


_FEDERATED_STEPS = (
    "a federated job's horizon is its rounds (each client trains its epochs every round): "
    "give rounds= and epochs= instead"
)
_NO_MAX_STEPS = {name: _FEDERATED_STEPS for name in ("fedavg", "fedprox", "qfedavg")}
_NO_VALIDATE_EVERY = _NO_MAX_STEPS
VALIDATE_EVERY = frozenset({"local", "data_parallel", "diloco"})
"""The strategies that validate every ``validate_every`` steps (DiLoCo's replicas synchronise
there, to hold the global model)."""


def check_validation(msg: Submit, inputs: JobInputs) -> None:
    """Refuse validation data that cannot be evaluated: a split of no dataset, rows and labels
    that do not pair up, or no labels where the job's loss needs them.

    Raises:
        RequestRefused: ``BAD_REQUEST`` saying which.
    """
    if msg.val_split is not None and (msg.dataset is None or msg.x_val is not None):
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            "val_split names a split of the workers' dataset: the job trains on one "
            "(dataset) and sends no x_val",
        )
    if msg.x_val is None:
        if msg.y_val is not None:
            raise RequestRefused.of(ErrorCode.BAD_REQUEST, "validation labels y_val need x_val")
        return
    torch_nodes = inputs.differentiable()
    for name, data in (("x_val", msg.x_val), ("y_val", msg.y_val)):
        problem = batch_problem(data, name)
        if problem is not None:
            raise RequestRefused.of(ErrorCode.BAD_REQUEST, problem)
    if msg.y_val is None:
        if torch_nodes and torch_nodes[-1] in inputs.labelled():
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"validation data is x_val and y_val: node {torch_nodes[-1]!r} needs labels",
            )
        if not rows_of(msg.x_val):
            raise RequestRefused.of(ErrorCode.BAD_REQUEST, "x_val must hold at least one row")
        return
    rows = [rows_of(v) for v in (msg.x_val, msg.y_val)]
    if None in rows or rows[0] != rows[1] or not rows[0]:
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            f"x_val and y_val must hold as many rows, at least one (got {rows[0]} and {rows[1]})",
        )


SUMMARY_NODES = 32
"""Node ids a job's record keeps (the graph itself is the job's, not the record's)."""


def summary_of(msg: Submit, placement: Placement, owner: str) -> dict[str, Any]:
    """What the job's record keeps of its submit message (no data, no code)."""
    ids = msg.graph.node_ids
    summary = {
        # the first ones, and how many: a record stays small however large the graph
        "node_ids": [capped(n, 64) for n in ids[:SUMMARY_NODES]],
        "nodes": len(ids),
        "strategy": _shortened(msg.strategy.model_dump()),
        "rows": rows_of(msg.x),
        "dataset": msg.dataset,
        "placement": placement.describe(),
        "owner": owner,
        "name": msg.name,
        "file": msg.file,
        "priority": msg.priority,
        "preemptible": msg.preemptible,
        "slots": msg.slots,
        "time_limit": msg.time_limit,
    }
    return summary | ({"resume_from": msg.resume_from} if msg.resume_from is not None else {})


def _shortened(value: Any) -> Any:
    """``value`` (a strategy's options) with each list cut to its first :data:`SUMMARY_NODES`
    items and a note of how many in all, each string to 64 characters: a ModelParallel job's
    partitions name every node of its graph, and a record kept them all (1 MB a job)."""
    if isinstance(value, dict):
        return {k: _shortened(v) for k, v in value.items()}
    if isinstance(value, list):
        kept = [_shortened(v) for v in value[:SUMMARY_NODES]]
        return kept if len(value) <= SUMMARY_NODES else [*kept, f"... ({len(value)} in all)"]
    return capped(value, 64) if isinstance(value, str) else value


def placement_of(strategy: Strategy, inputs: JobInputs) -> Placement:
    """The strategy's placement, also requiring the job's dataset on every worker, or, for a
    placement by slots, on the slots that read it (:meth:`Strategy.dataset_slots`)."""
    placement = strategy.placement()
    if inputs.sandboxed:
        placement = dataclasses.replace(placement, sandboxed=True)
    name = inputs.dataset
    if name is None:
        return placement
    reading = strategy.dataset_slots(len(placement.slots))
    slots = tuple(
        dataclasses.replace(slot, dataset=name) if k in reading else slot
        for k, slot in enumerate(placement.slots)
    )
    return dataclasses.replace(placement, dataset=name, slots=slots)


WAIT_HINT = (
    "; to wait for such a worker instead, submit with wait_for_workers=SECONDS "
    "(somatize submit --wait-for-workers SECONDS)"
)
"""What every refusal for want of a worker ends with: the way to queue the job anyway."""


def check_workers(
    placement: Placement, inputs: JobInputs, workers: Sequence[WorkerRecord], waits: bool
) -> None:
    """Refuse a job the registered ``workers`` could never run (:func:`check_targets`, then
    datasets without labels or with rows that disagree), unless it ``waits`` for workers
    (``wait_for_workers``): then workers yet to come may.

    Raises:
        RequestRefused: ``NO_WORKERS`` or ``BAD_REQUEST`` saying why.
    """
    if waits:
        return
    known = [w.identity for w in workers]
    check_targets(placement, known)
    why = unlabelled(inputs, workers) or unequal_stage_rows(placement, known)
    if why is not None:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, why)


def check_targets(placement: Placement, known: Sequence[WorkerIdentity]) -> None:
    """Refuse a placement pinned to a worker id or tag, a dataset or a device no known worker
    could ever take, or that needs more such workers than are known, busy or idle (instead of
    queueing it forever), listing the workers, tags, datasets and devices that exist, and the
    nearest names to a name no worker has.

    Raises:
        RequestRefused: ``NO_WORKERS`` saying which.
    """
    pinned = [_target_of(placement), *placement.slots]
    for slot in (s for s in pinned if s is not None):
        if not any(dataclasses.replace(slot, device=None, dataset=None).answers(w) for w in known):
            tags = sorted({t for w in known for t in w.tags})
            ids = [w.id for w in known]
            near = _nearest(slot.id, ids) if slot.id is not None else _nearest(slot.tag, tags)
            raise _no_workers(
                f"no worker answers to {slot}{near}: workers {listed(ids)}, tags {listed(tags)}"
            )
    wanted_data = placement.dataset
    if wanted_data is not None and not any(wanted_data in w.datasets for w in known):
        names = sorted({name for w in known for name in w.datasets})
        raise _no_workers(
            f"no worker has dataset {wanted_data!r}{_nearest(wanted_data, names)} (the workers "
            f"have {listed(names)})",
            dataset=wanted_data,
        )
    if placement.sandboxed and known and not any(w.sandbox in SANDBOXES for w in known):
        said = ", ".join(f"{w.id} {w.sandbox or 'unsaid'}" for w in known)
        raise _no_workers(
            f"the job asks for sandbox='required', and no worker runs job code sandboxed "
            f"(workers: {said}): start them with somatize-worker --sandbox auto"
        )
    if placement.network and known and not any(w.network for w in known):
        raise _no_workers(
            "the job trains on the torch collective, which dials between workers, and every "
            "worker runs job code without network (somatize-worker --job-network off): use "
            "collective='auto' or 'coordinator' (transport='websocket' for ModelParallel)"
        )
    devices = sorted({w.device for w in known})
    for wanted in placement.devices():
        if not any(device_fits(wanted, w.device) for w in known):
            raise _no_workers(
                f"no worker has device {wanted!r} ({_on_devices(known)})",
                device=wanted,
                devices=devices,
            )
    for slot in placement.slots:
        if not any(dataclasses.replace(slot, dataset=None).answers(w) for w in known):
            raise _no_workers(
                f"no worker answers to {slot} ({_on_devices(known)})",
                device=slot.device,
                devices=devices,
            )
        if not any(slot.answers(w) for w in known):
            serving = [w.id for w in known if slot.dataset in w.datasets]
            raise _no_workers(
                f"no worker answers to {slot}: the workers serving dataset {slot.dataset!r} "
                f"are {listed(serving)}",
                dataset=slot.dataset,
            )
    # Each fits, but fewer of them, busy or idle, than asked for. (With none registered yet a
    # job waits: workers starting beside the coordinator register after a first submit.)
    if known and placement.choose(known) is None:
        fitting = [w.id for w in known if placement.accepts(w)]
        raise _no_workers(
            f"the job needs {placement.describe()}, and {len(fitting)} of the registered "
            f"workers can take it: {listed(fitting)}",
            workers=placement.workers,
            fitting=fitting,
        )


def no_workers_after_wait(
    placement: Placement, known: Sequence[WorkerIdentity], seconds: float
) -> ErrorInfo:
    """Why a job fails that waited ``seconds`` (``wait_for_workers``) for workers to take
    ``placement``: what no ``known`` worker has, or that too few of them were free."""
    why = f"{placement.describe()} did not become free"
    try:
        check_targets(placement, known)
    except RequestRefused as exc:
        why = exc.info.message.removesuffix(WAIT_HINT)
    message = f"waited {seconds:g} s for its workers (wait_for_workers): {why}"
    return ErrorInfo(code=ErrorCode.NO_WORKERS, message=message)


def _target_of(placement: Placement) -> Target | None:
    """The worker id or tag a placement by count is pinned to, as a target (``None``: any)."""
    if placement.worker_id is not None:
        return Target(id=placement.worker_id)
    return Target(tag=placement.tag) if placement.tag is not None else None


def _nearest(name: str | None, names: Sequence[str]) -> str:
    """`` (did you mean 'dp'?)``: the name nearest to one no worker has, if any is near."""
    return did_you_mean(name or "", sorted(set(names)))


def _no_workers(message: str, **detail: Any) -> RequestRefused:
    return RequestRefused.of(ErrorCode.NO_WORKERS, message + WAIT_HINT, **detail)


def _on_devices(known: Sequence[WorkerIdentity]) -> str:
    """The known workers and their devices, as a refusal lists them."""
    return "workers: " + (", ".join(f"{w.id} {w.device}" for w in known) or "none")


def unlabelled(inputs: JobInputs, workers: Iterable[WorkerRecord]) -> str | None:
    """Why a job that trains TorchFilters on the workers' dataset cannot: every worker that
    serves it announced rows without labels (``y``). ``None`` when some has them, when what it
    holds is not known (a path for a loader), or when the job needs none."""
    name = inputs.dataset
    if name is None or inputs.loader is not None or not inputs.differentiable():
        return None
    served = [w for w in workers if name in w.datasets]
    if not served or any(w.datasets[name].x is None or w.datasets[name].y for w in served):
        return None
    return (
        f"dataset {name!r} has no labels (y) on {listed([w.id for w in served])}: its "
        "TorchFilters cannot train on it (serve it with a y.npy, or a y in the .npz)"
    )


def unequal_stage_rows(placement: Placement, known: Sequence[WorkerIdentity]) -> str | None:
    """Why a placement by slots whose first and last slots read the job's dataset (a pipeline's
    first stage reads ``x``, its last ``y``) cannot run on the workers known now: whichever
    two could take those slots, their datasets' rows differ. ``None`` when some pair agrees,
    or when what a candidate holds is not known (no worker yet, a loader's path)."""
    reading = [slot for slot in placement.slots if slot.dataset is not None]
    if len(reading) < 2 or placement.dataset is None:
        return None
    name, first, last = placement.dataset, reading[0], reading[-1]
    firsts = [w for w in known if first.answers(w)]
    lasts = [w for w in known if last.answers(w)]
    rows = {w.id: w.datasets[name] for w in firsts + lasts}
    if not firsts or not lasts or any(r is None for r in rows.values()):
        return None
    if any(a.id != b.id and rows[a.id] == rows[b.id] for a in firsts for b in lasts):
        return None
    said = ", ".join(f"{w} {rows[w]}" for w in sorted(rows))
    return (
        f"dataset {name!r}: the first stage ({first}) reads x and the last ({last}) y, and "
        f"their rows must agree; the workers that could take them hold {said} rows"
    )
