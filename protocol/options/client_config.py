"""FedAvg's per-round client config: what each round tells its clients' training.

The SDK takes ``client_config``, a function of the round (1, 2, ...) returning a dict, and
calls it for every round when the strategy is built: the coordinator never runs a client's
code, and a bad value is refused at submit, naming the round. It travels as the list of those
dicts, one per round. Each dict may set:

* ``lr`` — the learning rate of the clients' fresh optimizers that round (> 0): a decay by
  round, say;
* ``local_epochs`` — that round's local epochs (a positive integer), in place of the
  strategy's ``local_epochs``;
* ``batch_size`` — that round's local batch size (a positive integer), in place of the
  TorchFilters' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CLIENT_CONFIG_KEYS", "check_client_config", "client_configs"]

CLIENT_CONFIG_KEYS = ("lr", "local_epochs", "batch_size")
"""What a round's client config may set."""


def client_configs(make: Callable[[int], Any], rounds: int) -> list[dict[str, Any]]:
    """``make(1)``, ..., ``make(rounds)``, each checked.

    Raises:
        ValueError: ``make`` is not callable, raised, or returned something refused; the
            message names the round.
    """
    if not callable(make):
        raise ValueError(
            f"client_config must be a function of the round returning a dict, not {make!r}"
        )
    out = []
    for r in range(1, rounds + 1):
        try:
            config = make(r)
        except Exception as exc:
            raise ValueError(f"client_config({r}) raised {type(exc).__name__}: {exc}") from exc
        out.append(_checked(config, f"client_config({r}) returned {config!r}:"))
    return out


def check_client_config(value: object, rounds: int) -> None:
    """Refuse a wire ``client_config`` that is not one checked dict per round.

    Raises:
        ValueError: what is wrong, naming the round.
    """
    if not isinstance(value, list) or len(value) != rounds:
        raise ValueError(
            f"client_config must be a list of {rounds} objects (one per round), not {value!r}"
        )
    for r, config in enumerate(value, start=1):
        _checked(config, f"client_config of round {r} ({config!r}):")


def _checked(config: object, where: str) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise ValueError(f"{where} a round's client config must be a dict")
    unknown = sorted(str(k) for k in config if k not in CLIENT_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{where} it may set {list(CLIENT_CONFIG_KEYS)}, not {unknown}")
    lr = config.get("lr")
    if lr is not None and (
        isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0
    ):
        raise ValueError(f"{where} lr must be a finite number > 0, not {lr!r}")
    for key in ("local_epochs", "batch_size"):
        count = config.get(key)
        if count is not None and (
            not isinstance(count, int) or isinstance(count, bool) or count < 1
        ):
            raise ValueError(f"{where} {key} must be a positive integer, not {count!r}")
    return {key: config[key] for key in CLIENT_CONFIG_KEYS if key in config}
