"""What the coordinator keeps on its own disk, and what it reads of the files its workers keep.

:mod:`~coordinator.storage.store` (with :mod:`~coordinator.storage.schema`) records every job in
SQLite; :mod:`~coordinator.storage.checkpoints` writes, reads and times what a job resumes from,
whole or not at all through :mod:`~coordinator.storage.disk`; :mod:`~coordinator.storage.kept_files`
reads what a run's replicas left on their workers' disks a piece at a time. The jobs use it and
the strategies save through it; it imports neither (only :mod:`coordinator.errors` and the
protocol).
"""
