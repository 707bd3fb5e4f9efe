"""DataParallel: synchronous data-parallel SGD over N replicas.

:mod:`~coordinator.strategies.data_parallel.data_parallel` is the strategy; its gradients are
reduced either by torch.distributed between the replicas
(:mod:`~coordinator.strategies.data_parallel.torch_collective`) or through the coordinator
(:mod:`~coordinator.strategies.data_parallel.star`, folding replies as they arrive:
:mod:`~coordinator.strategies.data_parallel.mean_fold`);
:mod:`~coordinator.strategies.data_parallel.elastic` replaces a lost replica and
:mod:`~coordinator.strategies.data_parallel.checkpoints` saves and restores a run.
"""
