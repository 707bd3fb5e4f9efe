"""The agent's side of its filter daemons: the daemons it keeps, started and spare
(:mod:`~worker.supervision.pool`); one daemon spawned, talked to and survived
(:mod:`~worker.supervision.supervisor`); its process and the non-blocking I/O on its pipes
(:mod:`~worker.supervision.process`); and the fork server a CPU worker starts them from
(:mod:`~worker.supervision.forked`). What a daemon runs inside is :mod:`worker.confinement`; the
daemon itself is :mod:`worker.daemon`.
"""
