"""Jobs: submitted, queued, placed on workers, run by their strategy, recorded.

:mod:`~coordinator.jobs.submission` checks what a submit asks for;
:mod:`~coordinator.jobs.manager` queues, places, runs, restarts and ends jobs (a placed job's
strategy context is made there), :mod:`~coordinator.jobs.restarts` decides when a failed job goes
back to its checkpoint; :mod:`~coordinator.jobs.events` and :mod:`~coordinator.jobs.log` say
what happened; :mod:`~coordinator.jobs.files` keeps what a restarted coordinator needs of each
live job: its submit message, which is also what the job's inputs are read from, over a memory
map. What they record and resume from is kept in :mod:`coordinator.storage`.
"""
