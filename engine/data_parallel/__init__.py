"""A data-parallel replica: in a torch.distributed group, the loop it runs
(:mod:`~engine.data_parallel.replica`), the plan it walks (:mod:`~engine.data_parallel.plan`),
how it trains, one class per mode (:mod:`~engine.data_parallel.modes`: DDP, DiLoCo over the
group or through the coordinator, FSDP2's shards), its model sharded by FSDP2
(:mod:`~engine.data_parallel.sharding`, with :mod:`~engine.data_parallel.dcp_metadata`: a
sharded checkpoint's index read without trusting its writer), DiLoCo's outer step
(:mod:`~engine.data_parallel.outer_step`), and what its gradients travel as
(:mod:`~engine.data_parallel.compression`); through the coordinator, one step per request
(:mod:`~engine.data_parallel.star_replica`). The coordinator's side is
:mod:`coordinator.strategies.data_parallel`.
"""
