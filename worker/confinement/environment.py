"""The environment a filter daemon starts with: an allow-list, never the agent's secrets.

A job's filters are code a client sent; they run in the daemon with its environment. The agent's
own environment may hold its worker token (``SOMATIZE_WORKER_TOKEN``, as compose passes it),
cloud credentials, anything its operator exported: the daemon gets none of it. It gets what
Python, torch, CUDA, NCCL/gloo and the BLAS libraries read (:data:`ALLOWED`,
:data:`ALLOWED_PREFIXES`), the variables the operator names with ``--daemon-env NAME``, and
what the agent itself sets for it (the datasets, ``PYTHONPATH``). The tokens are refused even
when named. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["ALLOWED", "ALLOWED_PREFIXES", "NEVER", "daemon_environment", "refused_names"]

ALLOWED = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONWARNINGS",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
"""Variables a daemon inherits from the agent."""

ALLOWED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "NVIDIA_", "OMP_", "MKL_", "KMP_")
"""Prefixes of the variables a daemon inherits: locale, CUDA, the collectives, torch, BLAS."""

NEVER = frozenset({"SOMATIZE_WORKER_TOKEN", "SOMATIZE_TOKEN"})
"""Variables no daemon gets, whoever asks: the coordinator's tokens."""


def refused_names(names: Iterable[str]) -> list[str]:
    """Which of ``names`` (``--daemon-env``) may never be passed to a daemon."""
    return sorted(set(names) & NEVER)


def daemon_environment(
    parent: Mapping[str, str], passed: Iterable[str] = (), own: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The daemon's environment.

    Args:
        parent: the agent's environment (``os.environ``).
        passed: more names to inherit (``--daemon-env``); :data:`NEVER`'s are still left out.
        own: what the agent sets for the daemon, over whatever it inherits.
    """
    extra = set(passed) - NEVER
    inherited = {
        name: value
        for name, value in parent.items()
        if name not in NEVER
        and (name in ALLOWED or name in extra or name.startswith(ALLOWED_PREFIXES))
    }
    return {**inherited, **(own or {})}
