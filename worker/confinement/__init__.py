"""What a job's filter daemon runs inside, so that job code cannot reach past its job: the sandbox
(:mod:`~worker.confinement.sandbox`: bubblewrap, another uid, or none; chosen once, applied to
every daemon), the file system a root agent's sandbox starts from
(:mod:`~worker.confinement.sandbox_root`), a cgroup of its own (:mod:`~worker.confinement.cgroup`)
and the limits counted over it (:mod:`~worker.confinement.limits`), the environment it starts
with (:mod:`~worker.confinement.environment`), and the machine's process table
(:mod:`~worker.confinement.procfs`).
"""
