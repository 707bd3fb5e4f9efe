"""Jobs: submitted, queued, placed on workers, run by their strategy, recorded.

:mod:`~coordinator.jobs.submission` checks what a submit asks for;
:mod:`~coordinator.jobs.manager` queues, places and runs jobs;
:mod:`~coordinator.jobs.placed` is a job that has its workers;
:mod:`~coordinator.jobs.events` and :mod:`~coordinator.jobs.log` say what happened;
:mod:`~coordinator.jobs.store` (with :mod:`~coordinator.jobs.store_schema` and
:mod:`~coordinator.jobs.store_retry`) records every job in SQLite;
:mod:`~coordinator.jobs.checkpoints` and :mod:`~coordinator.jobs.checkpoint_store` keep what a
job resumes from, :mod:`~coordinator.jobs.files`, :mod:`~coordinator.jobs.specs`,
:mod:`~coordinator.jobs.paths` and :mod:`~coordinator.jobs.spill` what a restart needs on disk;
:mod:`~coordinator.jobs.restarts` decides when a failed job goes back to its checkpoint.
"""
