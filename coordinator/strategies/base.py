"""What every strategy shares: its inputs, its placement needs, its event callback, and the
interface the job manager drives (:class:`Strategy`: built from its options model, placed,
validated, prepared, run)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from coordinator.context import StrategyContext, Target, WorkerIdentity
from coordinator.errors import StrategyFailed, StrategyOptionsError
from coordinator.storage.checkpoints import JobCheckpoints
from coordinator.storage.kept_files import KeptFileSource
from protocol.daemon import StageRequest
from protocol.filter_buffers import FilterBuffer
from protocol.messages import SANDBOXES, NodeInfo
from protocol.options import strategies as so
from protocol.options.base import CheckpointOptions, RestartOptions
from protocol.options.devices import device_fits

T = TypeVar("T")

__all__ = [
    "Emit",
    "JobInputs",
    "Placement",
    "ShardedStates",
    "Strategy",
    "StrategyFailed",
    "StrategyOptionsError",
    "concurrently",
    "parse_options",
]

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``await emit(event, data)``: record a job event (``"progress"`` with step, loss...)."""


@dataclass(frozen=True)
class ShardedStates:
    """A sharded run's final states as its replicas hold them: ``keep(r)`` has replica ``r``
    of the ``replicas`` leave its pieces of the model on its worker's disk, while the run's
    workers are still held: one file, :data:`~protocol.files.shard_pieces.PIECES_FILE` (its
    ``dist_pieces`` answer, :mod:`protocol.files.shard_pieces`), to be read a piece at a time and
    released; ``plain``: the plain filters' states; ``node_ids``: the nodes. The job keeps
    the pieces one replica at a time (:mod:`coordinator.jobs.result_pieces`) and the client
    joins them: the whole model is never in the coordinator's memory, nor a replica's share
    of it."""

    replicas: int
    keep: Callable[[int], Awaitable[KeptFileSource]]
    plain: dict[str, Any]
    node_ids: list[str]


@dataclass(frozen=True)
class JobInputs:
    """What a job trains: the graph (node ids, pickled filters, what the client declared of each
    node) and its data — sent along (``x``, ``y``) or each worker's own (``dataset``)."""

    node_ids: list[str]
    filters: dict[str, FilterBuffer]
    x: Any
    y: Any
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    dataset: str | None = None
    loader: bytes | None = None  # with dataset: the pickled code that opens it (the daemon's)
    checkpoints: JobCheckpoints | None = None  # given to a run by the job manager
    x_val: Any = None  # validation data sent along, evaluated at each epoch's (round's) end
    y_val: Any = None
    val_split: str | None = None  # or each worker's split of its own dataset
    sandboxed: bool = False  # placed only on workers that run job code sandboxed

    @property
    def validates(self) -> bool:
        """The job has validation data."""
        return self.x_val is not None or self.val_split is not None

    def own_data(self, name: str) -> StageRequest:
        """The request that stages each worker's own dataset under ``name``."""
        return StageRequest(name=name, dataset=self.dataset, loader=self.loader)

    def trained_shapes(self) -> dict[str, list[list[int]]] | None:
        """The shapes of each differentiable node's trainable parameters, as the client
        declared them (what a replica's gradients may hold, and no more); ``None`` when no
        node declared any (nothing to hold a tree to)."""
        shapes = {n: list(self.nodes[n].parameter_shapes) for n in self.differentiable()}
        return shapes if any(shapes.values()) else None

    def differentiable(self) -> list[str]:
        """The nodes that train by gradient descent, in graph order."""
        return [n for n in self.node_ids if self.nodes.get(n, NodeInfo()).differentiable]

    def labelled(self) -> list[str]:
        """The differentiable nodes whose loss needs labels (``y``), in graph order: not those
        whose model computes its own loss, nor those with a ``step`` function."""
        return [n for n in self.differentiable() if self.nodes.get(n, NodeInfo()).labels]

    def missing_labels(self, node_id: str, strategy: str) -> str | None:
        """Why the run ending at ``node_id`` cannot train on the data sent (``x`` without the
        ``y`` its loss needs); ``None`` when it can (or trains on the workers' own data)."""
        if self.dataset is None and self.y is None and node_id in self.labelled():
            return f"{strategy} trains with labels: y is missing (node {node_id!r} needs them)"
        return None


@dataclass(frozen=True)
class Placement:
    """How many workers a strategy needs, and which qualify (by id, tags, dataset, device).

    With ``all_matching`` the job takes every idle worker that qualifies when it starts, and
    ``workers`` is the least it starts with. With ``slots`` each worker is pinned on its own (a
    pipeline stage to a worker id or tag, and maybe a device): the job takes one distinct idle
    worker per slot, in slot order. ``device`` (``None``: any; ``"cuda"``: any CUDA device)
    applies to every worker, slots included.
    """

    workers: int
    worker_id: str | None = None
    tag: str | None = None
    dataset: str | None = None
    all_matching: bool = False
    slots: tuple[Target, ...] = ()
    device: str | None = None
    sandboxed: bool = False  # every worker runs job code sandboxed (the job asked for it)
    network: bool = False  # every worker's job code shares its network (the torch collective)

    def choose(self, idle: Sequence[WorkerIdentity]) -> list[int] | None:
        """Indices into ``idle`` of the workers to take, or ``None`` when they are not there."""
        fits = [i for i, w in enumerate(idle) if self.accepts(w)]
        if not self.slots:
            if len(fits) < self.workers:
                return None
            return fits if self.all_matching else fits[: self.workers]
        chosen: list[int] = []
        for slot in self.slots:
            match = next((i for i in fits if i not in chosen and slot.answers(idle[i])), None)
            if match is None:
                return None
            chosen.append(match)
        return chosen

    def accepts(self, worker: WorkerIdentity) -> bool:
        if self.worker_id is not None and worker.id != self.worker_id:
            return False
        if self.dataset is not None and not self.slots and self.dataset not in worker.datasets:
            return False  # by slots, each slot says whether it reads the dataset
        if not device_fits(self.device, worker.device):
            return False
        if self.sandboxed and worker.sandbox not in SANDBOXES:
            return False
        if self.network and not worker.network:
            return False
        return self.tag is None or self.tag in worker.tags

    def devices(self) -> list[str]:
        """The devices this placement asks for (none when any device will do)."""
        wanted = [self.device] + [slot.device for slot in self.slots]
        return sorted({d for d in wanted if d is not None})

    def describe(self) -> str:
        what = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        if self.all_matching:
            what = f"every idle worker (at least {self.workers})"
        if self.worker_id is not None:
            what += f" with id {self.worker_id!r}"
        if self.tag is not None:
            what += f" tagged {self.tag!r}"
        if self.dataset is not None and not self.slots:
            what += f" with dataset {self.dataset!r}"
        if self.device is not None:
            what += f" on {self.device}"
        if self.sandboxed:
            what += " running job code sandboxed"
        if self.network:
            what += " with job network (the torch collective)"
        if self.slots:
            what += ": " + ", ".join(str(slot) for slot in self.slots)
        return what


class Strategy(ABC):
    """A training strategy: takes its options model whole (:attr:`options`; its class is
    :attr:`options_model`, whose ``name`` is the strategy's) and implements the hooks.

    A subclass sets :attr:`options_model` and narrows :attr:`options` to it."""

    options_model: ClassVar[type[RestartOptions]]
    name: ClassVar[str]

    saves_checkpoints: ClassVar[bool] = False
    """Whether a run saves checkpoints and resumes from one (``JobInputs.checkpoints``); a job
    of any other strategy queued again after a coordinator restart starts from the beginning."""

    options: RestartOptions

    def __init__(self, options: RestartOptions) -> None:
        self.options = options

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "options_model" in cls.__dict__:
            cls.name = cls.options_model.name

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """Build from the client's options, refusing unknown or invalid ones."""
        return cls(parse_options(cls.options_model, options))

    # -- what the job manager reads of the options (:mod:`coordinator.jobs`) ---------------------

    @property
    def checkpoint_every(self) -> int | None:
        """Steps (rounds) between checkpoints; ``None``: every epoch or 60 s; ``0``: never."""
        options = self.options
        return options.checkpoint_every if isinstance(options, CheckpointOptions) else None

    @property
    def shards_checkpoints(self) -> bool:
        """Whether its checkpoints hold each replica's shards of the model (a sharded run's)
        rather than whole states."""
        return False

    @property
    def keep_checkpoints(self) -> int:
        options = self.options
        if isinstance(options, CheckpointOptions):
            return options.keep_checkpoints
        return so.DEFAULT_KEEP_CHECKPOINTS

    @property
    def keep_on_success(self) -> str:
        """Which checkpoints stay once the job succeeded: ``"newest"``, ``"all"``, ``"none"``."""
        options = self.options
        return options.keep_on_success if isinstance(options, CheckpointOptions) else "newest"

    @property
    def max_restarts(self) -> int:
        """How many times a job that a lost worker, a crashed daemon or a broken collective
        would fail is queued again instead, to resume from its last checkpoint
        (:mod:`coordinator.jobs.manager`)."""
        return self.options.max_restarts

    @property
    def restart_timeout(self) -> float:
        """Seconds a restart waits for workers."""
        return self.options.restart_timeout

    # -- the hooks -------------------------------------------------------------------------------

    @abstractmethod
    def placement(self) -> Placement:
        """The workers this strategy needs."""

    def dataset_slots(self, slots: int) -> range | tuple[int, ...]:
        """Which of a placement's ``slots`` read the job's ``WorkerData`` (and must be on a
        worker serving it): all of them, unless the strategy says otherwise."""
        return range(slots)

    def validate(self, job: JobInputs) -> None:  # noqa: B027 - a hook: most accept any job
        """Refuse, with :class:`StrategyOptionsError`, a job this strategy cannot run (checked
        when it is submitted, before it waits for workers)."""

    async def prepare(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        """Set the placed workers up before training; what the job's ``placed`` event adds
        (how the run will go, and why). Runs before :meth:`run`, which must not rely on it:
        most strategies do nothing here."""
        return {}

    @abstractmethod
    async def run(
        self, ctx: StrategyContext, job: JobInputs, emit: Emit
    ) -> dict[str, Any] | ShardedStates:
        """Train and return the final states by node id (a sharded run: as its replicas hold
        them, :class:`ShardedStates`)."""


STARTS_PER_TURN = 64
"""Calls :func:`concurrently` starts per turn of the event loop."""


async def concurrently(*calls: Awaitable[T]) -> list[T]:
    """Await per-worker calls concurrently; the first failure cancels the others and is raised.

    (``asyncio.gather`` alone would leave the other calls running, orphaned, after a failure.)
    They start :data:`STARTS_PER_TURN` at a time, a turn of the loop apart: a call runs until
    its first suspension when it starts, and ten thousand of those (a FedAvg round's clients
    building their requests) in one turn would keep the loop from its sockets for a second.
    """
    tasks: list[asyncio.Future[T]] = []
    failures: list[BaseException] = []

    def note(task: asyncio.Future[T]) -> None:
        if not task.cancelled() and (failure := task.exception()) is not None:
            failures.append(failure)

    try:
        for call in calls:
            if tasks and len(tasks) % STARTS_PER_TURN == 0:
                await asyncio.sleep(0)  # the ones started run their first steps; sockets polled
                if failures:
                    raise failures[0]
            tasks.append(asyncio.ensure_future(call))
            tasks[-1].add_done_callback(note)
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for call in calls[len(tasks) :]:  # never started: closed, not left "never awaited"
            if asyncio.iscoroutine(call):
                call.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def parse_options(model: type[so.T], options: Mapping[str, Any]) -> so.T:
    """A strategy's options as the client sent them, checked by the shared ``model``.

    Raises:
        StrategyOptionsError: an option it does not take or cannot accept, named.
    """
    try:
        return so.parse(model, options, so.Caller.WIRE)
    except ValueError as exc:
        raise StrategyOptionsError(str(exc)) from None
