"""Whether a token file may be trusted: only one nobody else can read, and not empty. No I/O.

The coordinator's ``--worker-token-file``/``--client-token-file`` and the agent's
``--token-file`` read the file once (its mode from the open descriptor) and ask
:func:`token_file_problem`: a token file its group or others may read (``chmod 600`` it) is
refused, naming the mode, rather than trusted.
"""

from __future__ import annotations

import stat

__all__ = ["token_file_problem"]


def token_file_problem(path: str, mode: int, text: str) -> str | None:
    """What is wrong with the token file at ``path`` of ``mode`` (``st_mode``) holding ``text``;
    ``None``: the token is ``text.strip()``."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"the token file {path} is open to others (mode {stat.S_IMODE(mode):04o}): chmod 600 it"
        )
    if not text.strip():
        return f"the token file {path} is empty"
    return None
