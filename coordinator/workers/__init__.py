"""The workers as the coordinator sees them, and how a job's commands reach them.

:mod:`~coordinator.workers.registry` keeps every worker that ever connected (its id, tags,
capabilities, datasets, connection and heartbeat); :mod:`~coordinator.workers.transport` runs a
job's strategy over the connections of the workers placed on it (``TransportContext``). The job
manager (:mod:`coordinator.jobs`) places jobs on them; the server attaches a worker here when it
says hello (:mod:`coordinator.server.worker_sessions`).
"""
