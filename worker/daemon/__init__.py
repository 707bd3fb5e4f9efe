"""The filter daemon: the subprocess that runs a job's code (``python -m worker.daemon``), and the
link both ends of it speak.

:mod:`~worker.daemon.main` reads command frames from its pipes and runs them on an
:class:`~engine.engine.Engine` (:mod:`~worker.daemon.requests` parses them,
:mod:`~worker.daemon.group_commands` holds the commands of a daemon in a torch.distributed group,
:mod:`~worker.daemon.secagg_client` its secure-aggregation clients);
:mod:`~worker.daemon.fork_server` forks daemons from a process that has imported torch already;
:mod:`~worker.daemon.allocator` is which ``malloc`` it runs. Both the daemon and the agent
speak :mod:`~worker.daemon.pipe` over :mod:`~worker.daemon.shared_memory`.

The agent's side of it is :mod:`worker.supervision`; what it runs inside, :mod:`worker.confinement`.
Importing this package imports nothing: the agent never imports torch through it.
"""
