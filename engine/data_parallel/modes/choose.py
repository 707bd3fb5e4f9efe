"""The mode a replica's plan chooses, once, by its kind
(:data:`protocol.daemon.ReplicaModeSpec`).

The sharded mode is imported when a plan chooses it: it imports torch.distributed.checkpoint,
a second of CPU that a daemon which never shards does not pay (a sandboxed job's daemon, which
starts anew, included)."""

from __future__ import annotations

from typing import assert_never

from engine.data_parallel.modes.ddp import DdpMode
from engine.data_parallel.modes.diloco_alone import DiLoCoAloneMode
from engine.data_parallel.modes.diloco_group import DiLoCoGroupMode
from engine.data_parallel.modes.mode import ReplicaMode, ReplicaParts
from engine.data_parallel.plan import ReplicaPlan
from engine.nodes import Node
from protocol.daemon import DdpSpec, DiLoCoAloneSpec, DiLoCoGroupSpec, ShardedSpec

__all__ = ["mode_for"]


def mode_for(
    plan: ReplicaPlan, run: list[Node], parts: ReplicaParts, carried: ReplicaMode
) -> ReplicaMode:
    """The mode ``plan`` trains ``run`` in, set up over the replica's ``parts``; ``carried``:
    what the mode before left for it (DiLoCo's outer step, for a plan that regroups).

    Raises:
        EngineError: ``BAD_REQUEST`` before a join (every mode but DiLoCo alone trains in a
            group); ``COLLECTIVE_FAILED`` when the group broke.
    """
    match plan.mode:
        case DdpSpec() as spec:
            return DdpMode(spec, plan, run, parts)
        case DiLoCoGroupSpec() as spec:
            return DiLoCoGroupMode(spec, plan, run, parts, carried)
        case DiLoCoAloneSpec() as spec:
            return DiLoCoAloneMode(spec, plan, run, parts)
        case ShardedSpec() as spec:
            from engine.data_parallel.modes.sharded import ShardedMode

            return ShardedMode(spec, plan, run, parts)
        case _:
            assert_never(plan.mode)
