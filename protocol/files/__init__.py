"""Files that travel between processes, and their names: what a call's result holds for its
worker to keep (:mod:`~protocol.files.kept_files`), the files of a sharded checkpoint
(:mod:`~protocol.files.shard_files`), and a sharded model made whole from its replicas' pieces
(:mod:`~protocol.files.shard_pieces`). No I/O.
"""
