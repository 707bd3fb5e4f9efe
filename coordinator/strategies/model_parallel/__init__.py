"""ModelParallel: the graph split in pipeline stages on different workers.

:mod:`~coordinator.strategies.model_parallel.model_parallel` is the strategy and its partitions;
:mod:`~coordinator.strategies.model_parallel.schedule` the schedules as data (GPipe, 1F1B);
:mod:`~coordinator.strategies.model_parallel.run` one run of the pipeline, from its start or its
newest checkpoint (:mod:`~coordinator.strategies.model_parallel.checkpoints`), over WebSocket
calls (:mod:`~coordinator.strategies.model_parallel.executor`) or torch.distributed
point-to-point (:mod:`~coordinator.strategies.model_parallel.torch_transport`).
"""
