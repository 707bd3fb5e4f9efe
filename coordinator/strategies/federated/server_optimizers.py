"""Server optimizers for FedAvg: what the coordinator does with a round's averaged model.

With x_t the global model and x̄ the round's average of the client models (weighted by example
count, :func:`~coordinator.strategies.aggregate.weighted_mean`), the server treats
Δ_t = x̄ − x_t as a pseudo-gradient and steps on it (Reddi et al. 2021, "Adaptive Federated
Optimization", Algorithm 2, with the average of the client updates, x̄ − x_t):

* :class:`FedAvgServer` — plain FedAvg (McMahan et al. 2017): x_{t+1} = x̄.
* :class:`FedAvgM` — server momentum (Hsu et al. 2019, "Measuring the Effects of Non-Identical
  Data Distribution for Federated Visual Classification"): "v ← βv + Δw; w ← w − v", with
  Δw = x_t − x̄ and a server learning rate η; here m_t = β m_{t−1} + Δ_t,
  x_{t+1} = x_t + η m_t, m_0 = 0 (with β = 0 and η = 1 this is FedAvg).
* :class:`FedAdagrad` — "m_t = β1 m_{t−1} + (1 − β1) Δ_t; v_t = v_{t−1} + Δ_t²;
  x_{t+1} = x_t + η m_t / (√v_t + τ)".
* :class:`FedAdam` — "m_t = β1 m_{t−1} + (1 − β1) Δ_t; v_t = β2 v_{t−1} + (1 − β2) Δ_t²;
  x_{t+1} = x_t + η m_t / (√v_t + τ)".
* :class:`FedYogi` — as FedAdam but
  "v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)".

As in the paper, the moments start at m_{−1} = 0 and v_{−1} = τ² (Algorithm 2 asks for
v_{−1} ≥ τ²), and there is no bias correction. Everything is elementwise, leaf by leaf, on the
float leaves of the state, computed in float64 and cast back to the type and dtype of x̄'s leaf.
The moments are kept per leaf path between rounds. Integer, bool and non-numeric leaves (a
BatchNorm ``num_batches_tracked``, a filter's name) have no gradient: they are taken from x̄ as
they are. Complex leaves are refused by the moment-based optimizers, whose rules are written
for real numbers.

Each takes its options model (:mod:`protocol.options.server_optimizers`: the hyperparameters,
their defaults and their checks, defined once) and implements the maths; :func:`for_options`
builds the one a model asks for, :func:`from_options` the one a name and hyperparameters do;
:func:`step_on` is a round's step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

import numpy as np

from coordinator.errors import StrategyFailed
from coordinator.strategies.aggregate import (
    AggregationError,
    Path,
    Tree,
    describe,
    leaf_kind,
    leaf_shape,
    like,
    to_numpy,
)
from protocol.errors import ErrorCode
from protocol.options.server_optimizers import (
    AdaptiveOptions,
    FedAdagradOptions,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
    PlainAveragingOptions,
    ServerOptimizerOptions,
    server_options,
)

Array: TypeAlias = np.ndarray[Any, np.dtype[np.float64]]
S = TypeVar("S", bound=ServerOptimizerOptions)
M = TypeVar("M", FedAdagradOptions, FedAdamOptions, FedYogiOptions, AdaptiveOptions)


class ServerOptimizer(ABC, Generic[S]):
    """Turns the global model and a round's average into the next global model.

    Subclasses set :attr:`options_model` (its ``name`` is the option value that selects them)
    and take an instance of it (default: its defaults).
    """

    options_model: ClassVar[type[ServerOptimizerOptions]]
    name: ClassVar[str]

    def __init__(self, options: S | None = None) -> None:
        self.options: S = options if options is not None else self.options_model()  # type: ignore[assignment]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "options_model" in cls.__dict__:
            cls.name = cls.options_model.name

    @abstractmethod
    def step(self, global_state: Tree, averaged: Tree) -> Tree:
        """x_{t+1} from x_t (``global_state``) and x̄ (``averaged``), keeping the moments.

        Args:
            global_state: the model the round's clients started from.
            averaged: the weighted mean of their trained models; same structure and shapes.

        Returns:
            The new global model: x̄'s structure and leaf types.

        Raises:
            AggregationError: the two trees differ in keys, shapes or leaf kinds, or a leaf's
                shape changed since an earlier round.
        """

    def state_dict(self) -> list[Any]:
        """What it keeps between rounds, as a checkpoint holds it (nothing for plain
        averaging)."""
        return []

    def load_state_dict(self, state: list[Any]) -> None:
        """Take back what :meth:`state_dict` gave (a resumed run's server optimizer)."""

    def __repr__(self) -> str:
        hyperparameters = self.options.hyperparameters().items()
        args = ", ".join(f"{key}={value!r}" for key, value in hyperparameters)
        return f"{type(self).__name__}({args})"


class FedAvgServer(ServerOptimizer[PlainAveragingOptions]):
    """Plain FedAvg: the average becomes the global model, x_{t+1} = x̄."""

    options_model = PlainAveragingOptions

    def step(self, global_state: Tree, averaged: Tree) -> Tree:
        """Return ``averaged`` itself (no check against ``global_state``, no copy)."""
        return averaged


class _MomentOptimizer(ServerOptimizer[S]):
    """Walks x_t and x̄ together and updates each float leaf with :meth:`_update`."""

    def __init__(self, options: S | None = None) -> None:
        super().__init__(options)
        self._moments: dict[Path, tuple[Array, ...]] = {}

    def state_dict(self) -> list[Any]:
        """``[[path, [moment, ...]], ...]``: each leaf's moments, under its path in the model."""
        return [[list(path), list(moments)] for path, moments in self._moments.items()]

    def load_state_dict(self, state: list[Any]) -> None:
        self._moments = {
            tuple(path): tuple(np.asarray(m, dtype=np.float64) for m in moments)
            for path, moments in state
        }

    def step(self, global_state: Tree, averaged: Tree) -> Tree:
        # The moments change only once the whole tree has stepped: a refused step keeps them.
        pending: dict[Path, tuple[Array, ...]] = {}
        new_state = self._walk((), global_state, averaged, pending)
        self._moments.update(pending)
        return new_state

    def _walk(
        self, path: Path, x: Tree, xbar: Tree, pending: dict[Path, tuple[Array, ...]]
    ) -> Tree:
        if isinstance(xbar, Mapping):
            if not isinstance(x, Mapping):
                raise _mismatch(path, xbar, x)
            for key in x:
                if key not in xbar:
                    raise AggregationError.at(
                        path, f"key {key!r} of the global model is missing from the average"
                    )
            for key in xbar:
                if key not in x:
                    raise AggregationError.at(
                        path, f"key {key!r} of the average is missing from the global model"
                    )
            return {
                key: self._walk((*path, key), x[key], value, pending) for key, value in xbar.items()
            }
        if isinstance(xbar, list | tuple):
            if not isinstance(x, list | tuple) or len(x) != len(xbar):
                raise _mismatch(path, xbar, x)
            items = [
                self._walk((*path, i), a, b, pending)
                for i, (a, b) in enumerate(zip(x, xbar, strict=True))
            ]
            return tuple(items) if isinstance(xbar, tuple) else items
        kind = leaf_kind(xbar)
        if kind == "complex":
            raise AggregationError.at(
                path, f"{self.name} has no update for complex leaves ({describe(xbar)})"
            )
        if kind != "float":
            return xbar
        if leaf_kind(x) != "float" or leaf_shape(x) != leaf_shape(xbar):
            raise _mismatch(path, xbar, x)
        x64 = np.asarray(to_numpy(x), dtype=np.float64)
        delta = np.subtract(to_numpy(xbar), x64, dtype=np.float64)
        moments = self._moments.get(path)
        if moments is None:
            moments = self._initial_moments(x64.shape)
        elif moments[0].shape != x64.shape:
            raise AggregationError.at(
                path,
                f"shape {list(x64.shape)} differs from {list(moments[0].shape)} in earlier rounds",
            )
        new_x, pending[path] = self._update(x64, delta, moments)
        return like(xbar, new_x)

    @abstractmethod
    def _initial_moments(self, shape: tuple[int, ...]) -> tuple[Array, ...]:
        """The moments of a leaf before its first round."""

    @abstractmethod
    def _update(
        self, x: Array, delta: Array, moments: tuple[Array, ...]
    ) -> tuple[Array, tuple[Array, ...]]:
        """x_{t+1} and the new moments of one leaf, from x_t, Δ_t and the old moments."""


class FedAvgM(_MomentOptimizer[FedAvgMOptions]):
    """FedAvg with server momentum: m_t = β m_{t−1} + Δ_t; x_{t+1} = x_t + η m_t (η ``lr``,
    β ``momentum``); with ``nesterov``, x_{t+1} = x_t + η (Δ_t + β m_t)."""

    options_model = FedAvgMOptions

    def _initial_moments(self, shape: tuple[int, ...]) -> tuple[Array, ...]:
        return (np.zeros(shape),)

    def _update(
        self, x: Array, delta: Array, moments: tuple[Array, ...]
    ) -> tuple[Array, tuple[Array, ...]]:
        (m,) = moments
        beta = self.options.momentum
        m = beta * m + delta
        step = delta + beta * m if self.options.nesterov else m
        return x + self.options.lr * step, (m,)


class _AdaptiveOptimizer(_MomentOptimizer[M]):
    """FedAdagrad, FedAdam and FedYogi: they differ only in how the second moment follows
    Δ_t² (and so in whether they take β2); η ``lr``, β1 ``beta1``, τ ``tau``."""

    def _initial_moments(self, shape: tuple[int, ...]) -> tuple[Array, ...]:
        return np.zeros(shape), np.full(shape, self.options.tau**2)

    def _update(
        self, x: Array, delta: Array, moments: tuple[Array, ...]
    ) -> tuple[Array, tuple[Array, ...]]:
        m, v = moments
        beta1, lr, tau = self.options.beta1, self.options.lr, self.options.tau
        m = beta1 * m + (1 - beta1) * delta
        v = self._second_moment(v, np.square(delta))
        return x + lr * m / (np.sqrt(v) + tau), (m, v)

    @abstractmethod
    def _second_moment(self, v: Array, delta2: Array) -> Array:
        """v_t from v_{t−1} and Δ_t²."""


class FedAdagrad(_AdaptiveOptimizer[FedAdagradOptions]):
    """Adagrad on the server (Reddi et al. 2021): v_t = v_{t−1} + Δ_t²."""

    options_model = FedAdagradOptions

    def _second_moment(self, v: Array, delta2: Array) -> Array:
        return v + delta2


class FedAdam(_AdaptiveOptimizer[FedAdamOptions]):
    """Adam on the server (Reddi et al. 2021): v_t = β2 v_{t−1} + (1 − β2) Δ_t² (β2
    ``beta2``)."""

    options_model = FedAdamOptions

    def _second_moment(self, v: Array, delta2: Array) -> Array:
        beta2 = self.options.beta2
        return beta2 * v + (1 - beta2) * delta2


class FedYogi(_AdaptiveOptimizer[FedYogiOptions]):
    """Yogi on the server (Reddi et al. 2021): v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)
    (β2 ``beta2``)."""

    options_model = FedYogiOptions

    def _second_moment(self, v: Array, delta2: Array) -> Array:
        return v - (1 - self.options.beta2) * delta2 * np.sign(v - delta2)


OPTIMIZERS: dict[str, type[ServerOptimizer[Any]]] = {
    cls.name: cls for cls in (FedAvgServer, FedAvgM, FedAdagrad, FedAdam, FedYogi)
}
"""The server optimizers by the name a client gives."""


def step_on(
    server: ServerOptimizer[Any], x: Tree, xbar: Tree, nodes: Sequence[str], r: int
) -> Tree:
    """x_{t+1} after round ``r``: ``server``'s step on ``nodes`` (the TorchFilters), the mean
    x̄ as it is for the others (plain filters, fitted anew each round); or ``StrategyFailed``."""
    current = {n: x[n] for n in nodes}
    try:
        stepped = server.step(current, {n: xbar[n] for n in nodes})
    except AggregationError as exc:
        raise StrategyFailed(
            ErrorCode.AGGREGATION_MISMATCH, f"round {r}: {server.name}: {exc}"
        ) from exc
    return {**xbar, **stepped}


def for_options(options: ServerOptimizerOptions) -> ServerOptimizer[Any]:
    """A new server optimizer (fresh moments) of the kind and hyperparameters ``options``
    says."""
    return OPTIMIZERS[options.name](options)


def from_options(name: str, options: Mapping[str, Any]) -> ServerOptimizer[Any]:
    """The server optimizer called ``name``, with hyperparameters from ``options``.

    Raises:
        ValueError: an unknown name, an option it does not take, or a value out of range.
    """
    return for_options(server_options(name, options))


def _mismatch(path: Path, xbar: Any, x: Any) -> AggregationError:
    return AggregationError.at(
        path, f"the average has {describe(xbar)}, the global model has {describe(x)}"
    )
