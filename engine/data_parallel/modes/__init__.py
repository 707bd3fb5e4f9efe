"""How a data-parallel replica trains, one class per mode, chosen once with its plan
(:func:`~engine.data_parallel.modes.choose.mode_for`, from the ``dist_plan`` request's
:data:`~protocol.daemon.ReplicaModeSpec`): DDP (:mod:`~engine.data_parallel.modes.ddp`),
DiLoCo over the group (:mod:`~engine.data_parallel.modes.diloco_group`), DiLoCo through the
coordinator with no group (:mod:`~engine.data_parallel.modes.diloco_alone`), and FSDP2's shards
(:mod:`~engine.data_parallel.modes.sharded`). Each has the one face the replica's step loop
(:mod:`engine.data_parallel.replica`) calls (:class:`~engine.data_parallel.modes.mode.ReplicaMode`).
"""
