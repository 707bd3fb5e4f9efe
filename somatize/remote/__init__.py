"""Training on a coordinator: the client that submits jobs and fetches what they learned
(:mod:`~somatize.remote.client`) over its connection (:mod:`~somatize.remote.connection`), a
submitted job's handle and events (:mod:`~somatize.remote.jobs`), and a sharded run's checkpoint
made whole on the client (:mod:`~somatize.remote.sharded_checkpoints`).
"""
