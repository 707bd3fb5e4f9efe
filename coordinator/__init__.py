"""The somatize coordinator: places training jobs on worker agents and runs their strategies.

:mod:`coordinator.server` is the daemon (its config, connections, HTTP, client requests and
status page); :mod:`coordinator.jobs` queues, places, runs, records and checkpoints jobs, in
what :mod:`coordinator.storage` keeps on disk;
:mod:`coordinator.workers` keeps the workers and reaches them (``TransportContext``);
:mod:`coordinator.strategies` runs a job over a :class:`~coordinator.context.StrategyContext`.
The server uses the jobs, the jobs the strategies and the workers; a strategy saves its
checkpoints through :mod:`coordinator.storage.checkpoints`.
"""
