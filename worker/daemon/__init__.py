"""The filter daemon: the subprocess that runs a job's code, and the agent's side of it.

In the daemon process (``python -m worker.daemon``): :mod:`~worker.daemon.main` reads command
frames from its pipes and runs them on an :class:`~engine.engine.Engine`
(:mod:`~worker.daemon.requests` parses them, :mod:`~worker.daemon.group_commands` holds the
commands of a daemon in a torch.distributed group, :mod:`~worker.daemon.secagg_client` its
secure-aggregation clients).

In the agent: :mod:`~worker.daemon.supervisor` starts one daemon per job, talks to it over
:mod:`~worker.daemon.pipe` and :mod:`~worker.daemon.shared_memory` and restarts it when it dies;
:mod:`~worker.daemon.pool` keeps a spare warm; :mod:`~worker.daemon.process` is one daemon
process and its non-blocking pipes; :mod:`~worker.daemon.forked` and
:mod:`~worker.daemon.fork_server` fork daemons from a process that has imported torch already;
:mod:`~worker.daemon.environment`, :mod:`~worker.daemon.limits` and :mod:`~worker.daemon.cgroup`
decide what a daemon sees and may use, :mod:`~worker.daemon.allocator` which ``malloc`` it runs.

Importing this package imports nothing: the agent never imports torch through it.
"""
