"""The agent's side of its filter daemons: the daemons it keeps, started and spare
(:mod:`~worker.supervision.pool`); one daemon started, talked to and survived
(:mod:`~worker.supervision.supervisor`); where its process starts, forked or fresh, inside its
sandbox and cgroup (:mod:`~worker.supervision.start`); the running process and the
non-blocking I/O on its pipes (:mod:`~worker.supervision.process`); and the fork server a CPU
worker starts them from (:mod:`~worker.supervision.forked`). What a daemon runs inside is
:mod:`worker.confinement`; the daemon itself is :mod:`worker.daemon`.
"""
