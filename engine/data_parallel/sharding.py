"""A data-parallel replica's model sharded by FSDP2 (torch's ``fully_shard``), read and saved
where its shards lie: never whole in one replica.

:class:`ShardedRun` shards the differentiable run a replica trains (its chain of TorchFilter
modules, ``parts``): each *unit* — every module of a class named in ``shard_units``, else each
filter module's children that hold parameters — is sharded with ``fully_shard`` over the
group's ranks, then the chain itself (what no unit took). Each replica then holds 1/N of every
parameter, gradient and optimizer moment; a unit's parameters are all-gathered for its forward
(and, resharded after it, again for its backward) and its gradients reduce-scattered, averaged
over the replicas as DDP's all-reduce averages them: the replica's loop is DDP's, and so is
the equivalence with ``graph.fit``. The optimizers are made over the sharded parameters. A
filter of ``precision="bf16"`` has its units gathered and run in bf16 through FSDP2's
``MixedPrecisionPolicy`` (:data:`BF16`), its gradients reduced and its weights kept in fp32.

The coordinator reads a sharded replica's model where its shards lie for the job's result
(:meth:`ShardedRun.pieces`: no collective, nothing gathered, no optimizer state): each
parameter's rows held here, and which of what it sends are such rows; it keeps the replicas'
pieces as they came and the client joins them (:mod:`protocol.files.shard_pieces`), so no replica,
and not the coordinator, ever holds the whole model for it; a checkpoint is each replica's
shards saved with torch.distributed.checkpoint (:meth:`ShardedRun.save_shards`,
:meth:`ShardedRun.load_shards`); an evaluation runs through the sharded chain
(:meth:`engine.data_parallel.modes.sharded.ShardedMode.evaluate`). A replica whose nodes arrive
with an optimizer state has it moved onto the sharded parameters.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as load_checkpoint
from torch.distributed.checkpoint.state_dict_saver import save as save_checkpoint
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engine.data_parallel.dcp_metadata import CheckedReader, MetadataRefused, checked_metadata
from engine.errors import EngineError
from engine.nodes import Node
from engine.optimizers import SCHEDULER, Optimizers
from engine.transfer import precision_of, to_cpu
from protocol.errors import ErrorCode
from protocol.files.shard_files import METADATA
from protocol.filters import ROWS

__all__ = ["BF16", "Sharded", "ShardedRun", "precision_policy", "unit_classes"]

WHOLE = StateDictOptions(full_state_dict=True)
"""State dicts of whole tensors: the optimizer state a replica's nodes arrive with, before they
are sharded."""

SAVE_PLANNER = DefaultSavePlanner(enable_plan_caching=True)
"""How a replica plans its shards' saves: each save's plans kept for the next, which a run's
unchanged shards make the same (torch.distributed.checkpoint's plan caching)."""

KeyPath = list[str | int]
"""Where a value lies in :meth:`ShardedRun._tree`'s answer: its keys, outermost first."""


def unit_classes(names: Sequence[str]) -> tuple[type, ...] | tuple[str, ...]:
    """The module classes ``names`` (qualified names) stand for, importable here; a name that
    is not (a class of the user's own module, pickled with the filter) stays a name, matched
    against a module's classes' qualified names."""
    found: list[Any] = []
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module_name), attribute))
        except (ImportError, AttributeError, ValueError):
            found.append(name)
    return tuple(found)


BF16 = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
)
"""A bf16 filter's units: parameters all-gathered in bf16 (half the bytes) and run in it, the
gradients reduce-scattered and kept in fp32 (as the sharded weights and the optimizer's state
are), what leaves them fp32."""


def precision_policy(run: Sequence[Node]) -> MixedPrecisionPolicy:
    """How FSDP2 casts the units of ``run``'s filters: :data:`BF16` when every one of them is
    ``precision="bf16"``, else nothing (fp32, or fp16 under its autocast and gradient
    scaler)."""
    if run and all(precision_of(node.filter) == "bf16" for node in run):
        return BF16
    return MixedPrecisionPolicy()


def _rows_held(chain: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The rows this replica holds of each parameter of ``chain`` that arrived as rows alone,
    by name (:func:`protocol.filters.split_rows`: on the ``meta`` device until sharded).

    Raises:
        EngineError: ``BAD_REQUEST``: a ``meta`` parameter came without its rows.
    """
    rows: dict[str, torch.Tensor] = {}
    for name, param in chain.named_parameters():
        if param.is_meta:
            held = getattr(param, ROWS, None)
            if held is None:
                raise EngineError(
                    ErrorCode.BAD_REQUEST, f"parameter {name} is on the meta device, no rows held"
                )
            rows[name] = held
    return rows


def _fill(chain: torch.nn.Module, rows: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """``chain``, sharded over ``meta`` parameters, made real on ``device``: each such shard
    filled from the rows this replica was given, every other parameter's shard and every
    buffer as it was (``to_empty`` allocates them all afresh).

    Raises:
        EngineError: ``STATE_MISMATCH``: rows that are not this replica's shard of them.
    """
    kept = {
        name: _local_of(p).detach().clone()
        for name, p in chain.named_parameters()
        if name not in rows
    }
    buffers = dict(chain.named_buffers())
    chain.to_empty(device=device)
    with torch.no_grad():
        for name, param in chain.named_parameters():
            local, source = _local_of(param), rows.get(name, kept.get(name))
            if source is None or source.shape != local.shape:
                said = None if source is None else list(source.shape)
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"parameter {name}: this replica's shard has shape {list(local.shape)}, "
                    f"the rows it was given {said}",
                )
            local.copy_(source)
        for name, buffer in chain.named_buffers():
            buffer.copy_(buffers[name])


def _local_of(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _is_unit(module: torch.nn.Module, units: Sequence[Any]) -> bool:
    """Whether ``module`` is of one of ``units`` (classes, or qualified names of classes)."""
    for unit in units:
        if isinstance(unit, type):
            if isinstance(module, unit):
                return True
        elif any(f"{k.__module__}.{k.__qualname__}" == unit for k in type(module).__mro__):
            return True
    return False


def _holds_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _load_whole(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], whole: dict[str, Any]
) -> None:
    """Load an optimizer state of whole tensors (``get_optimizer_state_dict``'s) into
    ``optimizers`` over ``model``'s parameters, sharded or not. A state with nothing per
    parameter (SGD without momentum, or no step taken yet) has only its groups' settings to
    give, which torch's loader cannot place on a device: those are copied."""
    per_parameter = [
        t for state in whole["state"].values() for t in state.values() if _is_tensor(t)
    ]
    if per_parameter:
        set_optimizer_state_dict(model, list(optimizers), whole, options=WHOLE)
        return
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    for group, saved in zip(groups, whole["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _local(value: Any, path: KeyPath, split: list[KeyPath]) -> Any:
    """``value`` as it travels from this replica: a sharded tensor as the rows held here
    (``path`` noted in ``split``); a tensor on the CPU as it is (the reply is encoded before
    the next command can step it: no copy of the shards is made for it), one elsewhere
    copied to the CPU."""
    if isinstance(value, DTensor):
        split.append(path)
        value = value.to_local()
    return to_cpu(value.detach()) if isinstance(value, torch.Tensor) else value


def _filled(saved: Any, now: Any) -> Any:
    """``saved`` (part of :meth:`ShardedRun.save_shards`' rest) with each sharded tensor it
    left out (``None``) taken from ``now``, the same part as the run holds it (keys matched as
    text: integer keys may have travelled as strings)."""
    if isinstance(now, DTensor):
        return now
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        by_text = {str(k): v for k, v in now.items()}
        return {k: _filled(v, by_text.get(str(k))) for k, v in saved.items()}
    return saved


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


@dataclass
class _Held:
    """What a node trains with while sharded: its module, optimizer and scheduler."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any


class Sharded:
    """The sharded chain as the replica's loop calls it (DDP's face): ``module``, a call, and
    ``no_sync`` (no reduce-scatter in the backwards it covers: accumulation)."""

    def __init__(self, chain: torch.nn.Module) -> None:
        self.module = chain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        assert isinstance(self.module, FSDPModule)
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


class ShardedRun:
    """The differentiable run ``run`` of a replica, its ``chain`` (``parts``: the filters'
    modules, in order) sharded over the group (module docstring).

    Args:
        chain: the run's modules as one module, ``chain.parts[k]`` the module of ``run[k]``.
        run: the run's nodes.
        optimizers: the replica's optimizers (made again over the sharded parameters).
        reshard: reshard each unit's parameters after its forward (``sharding="full"``), or
            keep them gathered until its backward (``"gradients"``).
        units: the module classes (or qualified names) sharded as one unit each; ``None``:
            each filter module's children that hold parameters.
    """

    def __init__(
        self,
        chain: torch.nn.Module,
        run: Sequence[Node],
        optimizers: Optimizers,
        reshard: bool,
        units: Sequence[Any] | None,
    ) -> None:
        self.chain, self.run, self.optimizers = chain, list(run), optimizers
        parts: Sequence[torch.nn.Module] = chain.parts  # type: ignore[assignment]
        rows = _rows_held(chain)  # the parameters of which this replica got its rows alone
        state = None if rows else self._whole_optimizer_state()  # before sharding
        for part, node in zip(parts, self.run, strict=True):
            chosen = (
                [m for m in part.modules() if _is_unit(m, units)]
                if units is not None
                else [m for m in part.children() if _holds_parameters(m)]
            )
            policy = precision_policy([node])
            for unit in reversed(chosen):  # inner units before those holding them
                fully_shard(unit, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(chain, reshard_after_forward=reshard, mp_policy=precision_policy(self.run))
        if rows:
            _fill(chain, rows, chain.device)  # type: ignore[arg-type]
        optimizers.reset(self.run)  # made again over the sharded parameters
        made = [optimizers.optimizer(node) for node in self.run]
        if state is not None:
            whole, schedulers = state
            _load_whole(chain, made, whole)
            for node, scheduler in zip(self.run, schedulers, strict=True):
                if node.scheduler is not None and scheduler is not None:
                    node.scheduler.load_state_dict(scheduler)
        self.wrapped = Sharded(chain)

    def held(self) -> dict[str, int]:
        """What this replica holds of the run: ``units`` sharded (the chain's own included)
        and ``parameter_bytes``, its shards of the trainable parameters (their gradients take
        as many; the optimizer's state that times its moments)."""
        held = 0
        for node in self.run:
            for p in node.filter.module.parameters():
                if p.requires_grad:
                    local = p.to_local() if isinstance(p, DTensor) else p
                    held += local.numel() * local.element_size()
        units = sum(1 for m in self.chain.modules() if isinstance(m, FSDPModule))
        return {"units": units, "parameter_bytes": held}

    def _whole_optimizer_state(self) -> tuple[dict[str, Any], list[Any]] | None:
        """The run's optimizers' whole state and their schedulers' (``None``: no node has an
        optimizer yet); any node without one gets a fresh one first."""
        if all(node.optimizer is None for node in self.run):
            return None
        made = [self.optimizers.optimizer(node) for node in self.run]
        schedulers = [None if n.scheduler is None else n.scheduler.state_dict() for n in self.run]
        return get_optimizer_state_dict(self.chain, made, options=WHOLE), schedulers

    def pieces(self) -> dict[str, Any]:
        """This replica's shards of the model, read where they lie (no collective, nothing
        gathered), for the job's result: ``states`` by node as an unsharded replica's
        ``get_state`` gives them, but with each sharded parameter as the rows of it held here
        (FSDP2 shards dim 0, in rank order); ``split``: the paths of those tensors. The
        buffers every replica holds alike. No optimizer state: a result does not keep it."""
        split: list[KeyPath] = []
        states = self._tree(lambda value, path: _local(value, path, split), optimizers=False)
        return states | {"split": split}

    def save_shards(self, directory: str) -> dict[str, Any]:
        """Save this replica's shards with torch.distributed.checkpoint into ``directory`` —
        a collective: every replica saves its own at once, replica 0 also the ``.metadata``
        that says where each shard lies — and return the rest, which every replica holds
        alike: :meth:`pieces`' answer with each sharded tensor ``None``, ``split`` the paths
        of those tensors (the checkpoint's key of ``split[i]`` is ``str(i)``)."""
        shards: dict[str, DTensor] = {}
        split: list[KeyPath] = []

        def rest(value: Any, path: KeyPath) -> Any:
            if isinstance(value, DTensor):
                shards[str(len(split))] = value
                split.append(path)
                return None
            return to_cpu(value.detach()) if isinstance(value, torch.Tensor) else value

        held = self._tree(rest)
        # Not synced: the files are read back at once for the reply (the coordinator's store
        # is what makes a checkpoint durable); the plans kept from one save to the next.
        writer = FileSystemWriter(directory, sync_files=False)
        save_checkpoint(shards, storage_writer=writer, planner=SAVE_PLANNER)
        return held | {"split": split}

    def load_shards(self, directory: str, rest: Mapping[str, Any]) -> None:
        """Load a checkpoint :meth:`save_shards` made (a collective: every replica at once):
        each replica reads, of the shards in ``directory``, the rows it holds now, straight
        into its parameters and optimizer moments; ``rest`` (that call's answer) gives the
        buffers, step counts, the groups' settings and the schedulers.

        Raises:
            EngineError: ``STATE_MISMATCH``: the checkpoint is of other tensors.
        """
        kept = self._held()
        made = [held.optimizer for held in kept if held.optimizer is not None]
        if made:  # moments to load into: torch's own initialisation (a step of zero lr)
            get_optimizer_state_dict(self.chain, made)
        saved = {tuple(path): str(i) for i, path in enumerate(rest["split"])}
        target: dict[str, torch.Tensor] = {}

        def into(value: Any, path: KeyPath) -> Any:
            if isinstance(value, DTensor):
                key = saved.get(tuple(path))
                if key is None:
                    raise EngineError(
                        ErrorCode.STATE_MISMATCH,
                        f"the checkpoint holds no shards of {'/'.join(map(str, path))}",
                    )
                target[key] = value
            return value

        now = self._tree(into)
        if len(target) != len(saved):
            raise EngineError(
                ErrorCode.STATE_MISMATCH,
                f"the checkpoint holds {len(saved)} sharded tensors, this model {len(target)}",
            )
        try:  # every replica has the same file: each refuses it before the collective
            checked_metadata((Path(directory) / METADATA).read_bytes())
        except (MetadataRefused, OSError) as exc:
            raise EngineError(
                ErrorCode.STATE_MISMATCH, f"the checkpoint's {METADATA} is refused: {exc}"
            ) from exc
        # In place, the tensors of ``now``; DCP's own plain unpickler never sees the file.
        load_checkpoint(target, storage_reader=CheckedReader(directory))
        for node, held in zip(self.run, kept, strict=True):
            key = node.node_id
            held.module.load_state_dict(_filled(rest["states"][key], now["states"][key]))
            saved_optimizer = rest["optimizers"].get(key)
            if held.optimizer is None or saved_optimizer is None:
                continue
            state = _filled(saved_optimizer["state"], now["optimizers"][key]["state"])
            groups = saved_optimizer["param_groups"]
            held.optimizer.load_state_dict(
                {"state": {int(i): v for i, v in state.items()}, "param_groups": groups}
            )
            if held.scheduler is not None and SCHEDULER in saved_optimizer:
                held.scheduler.load_state_dict(saved_optimizer[SCHEDULER])

    def _tree(self, leaf: Callable[[Any, KeyPath], Any], optimizers: bool = True) -> dict[str, Any]:
        """``states`` and (with ``optimizers``) ``optimizers`` by node, as an unsharded
        replica's ``get_state`` and ``get_optimizer_state`` give them (a scheduler's state with
        its optimizer's), each value — a tensor, sharded or not, a step count — given by
        ``leaf`` of it and its path."""
        states: dict[str, Any] = {}
        optimizer_states: dict[str, Any] = {}
        for node, held in zip(self.run, self._held(), strict=True):
            key = node.node_id
            module_state = held.module.state_dict()
            states[key] = {name: leaf(v, ["states", key, name]) for name, v in module_state.items()}
            if not optimizers:
                continue
            if held.optimizer is None:
                optimizer_states[key] = None
                continue
            saved = held.optimizer.state_dict()
            per_parameter = {
                index: {
                    name: leaf(v, ["optimizers", key, "state", index, name])
                    for name, v in moments.items()
                }
                for index, moments in saved["state"].items()
            }
            optimizer_states[key] = {"state": per_parameter, "param_groups": saved["param_groups"]}
            if held.scheduler is not None:
                optimizer_states[key][SCHEDULER] = held.scheduler.state_dict()
        if not optimizers:
            return {"states": states}
        return {"states": states, "optimizers": optimizer_states}

    def _held(self) -> list[_Held]:
        """What the run's nodes train with now: their modules, optimizers and schedulers."""
        return [_Held(n.filter.module, n.optimizer, n.scheduler) for n in self.run]
