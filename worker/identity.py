"""This agent's identity key: made once, kept in a file only its user can read.

The coordinator binds a worker id to the key of the first agent that registers with it (an id
chosen with ``--id``); a later registration of that id with another key — someone holding the
worker token, not the machine — is refused. The key never leaves the agent: its hello carries
the public half of a key pair derived from it and a signature of the connection's challenge
(:mod:`protocol.security.identity_proof`). The key lives
in ``--identity-file`` (by default ``~/.local/state/somatize/worker-<ID>.key``), created
``0600`` on the first start; a file that others can read is refused like a token file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from protocol.security.token_file import token_file_problem

__all__ = ["default_identity_file", "load_or_create_key"]


def default_identity_file(worker_id: str) -> Path:
    """Where the key of worker ``worker_id`` lives unless ``--identity-file`` says."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "somatize" / f"worker-{worker_id}.key"


def load_or_create_key(path: Path) -> str:
    """The key in ``path``; a new one, written there (``0600``, its directory ``0700`` when
    made), if the file does not exist.

    Raises:
        ValueError: the file cannot be read or written, is empty, or others can read it.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = secrets.token_urlsafe(32)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            with open(path, encoding="utf-8") as f:
                mode, text = os.fstat(f.fileno()).st_mode, f.read()
            problem = token_file_problem(str(path), mode, text)
            if problem is not None:
                raise ValueError(problem.replace("token file", "identity file")) from None
            return text.strip()
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            f.write(key + "\n")
        return key
    except OSError as exc:
        raise ValueError(f"cannot use the identity file {path}: {exc}") from exc
