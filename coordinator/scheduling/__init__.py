"""Who gets the workers: fair shares between clients, priorities, quotas, reservations for
gangs, and which running jobs are preempted to make room.

:mod:`~coordinator.scheduling.shares` holds what each client is owed (its share, quota and
priority ceiling) and has used lately; :mod:`~coordinator.scheduling.plan` decides, in one pass
over the queue, which jobs start where, which running jobs leave, and why each other job
waits. Both are pure logic; :mod:`coordinator.jobs.manager` runs them and carries them out.
"""
