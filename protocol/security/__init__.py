"""What the wire trusts, and on what grounds: a worker's proof that it holds its identity key
(:mod:`~protocol.security.identity_proof`), the credentials a stage presents on a peer link
(:mod:`~protocol.security.peer_credentials`), whether a token file may be trusted
(:mod:`~protocol.security.token_file`), and secure aggregation's building blocks
(:mod:`~protocol.security.secagg`). No I/O.
"""
