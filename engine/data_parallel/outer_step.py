"""DiLoCo's outer step on a replica (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", Algorithm 1).

Between two synchronisations every replica trains alone: its inner steps take its own slice of
each global batch with the filter's own optimizer, and nothing crosses the network. At a
synchronisation the replicas all-reduce their *pseudo-gradients* Δ = θ_global − θ_local (averaged
over the group, in buckets), and each takes the same outer step on the global weights it keeps —
SGD with momentum, Nesterov's by default (``torch.optim.SGD``, whose update with Δ as the
gradient is the paper's outer optimiser); they travel in fp32 or compressed
(:class:`engine.data_parallel.compression.CompressedMean`) — and starts its next inner steps from
them. Every replica holds the same global weights and outer momentum, so none of it travels.

A replica ``alone`` (DiLoCo through the coordinator, with compression) holds a
:class:`SyncPoint` instead: the weights of its last synchronisation, from which its
pseudo-gradients are read out compressed, and onto which the coordinator's outer update — the
step the coordinator took, compressed too — is added.

With ``sync_every=1``, an outer SGD of ``lr=1`` and no momentum, one synchronisation averages the
replicas' weights after one step each: with an inner SGD that is DataParallel's step, since each
replica's loss is weighted by its share of the global batch (:mod:`engine.data_parallel.replica`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.data_parallel.compression import CompressedMean
from engine.errors import EngineError
from protocol.compressed_trees import TreeCompressor, decode
from protocol.daemon import OuterStepSpec
from protocol.errors import BadCompressedTree, ErrorCode
from protocol.options.compression import Compression
from protocol.rules.fragments import Piece, blocking_steps, fragment_pieces
from protocol.rules.traffic import buckets

__all__ = ["OuterStep", "SyncPoint"]


class OuterStep:
    """The global weights of ``params`` and their outer optimizer, over the default process
    group (module docstring), in fragments (Streaming DiLoCo: :class:`_Fragment`); ``steps``
    is the run's length, after whose last step nothing is left in flight."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        spec: OuterStepSpec,
        compression: Compression | None = None,
        steps: int = 0,
    ) -> None:
        self.spec = spec
        self.params = list(params)
        try:
            cut = fragment_pieces([p.numel() for p in self.params], spec.fragments)
        except ValueError as exc:
            raise EngineError(ErrorCode.BAD_REQUEST, f"Streaming DiLoCo: {exc}") from exc
        self.fragments = [_Fragment(self.params, pieces, spec, compression) for pieces in cut]
        self.closing = blocking_steps(steps, spec.also)
        # One thread runs the exchanges that overlap inner steps, in the order they start: the
        # replicas' collectives then come in the same order on each.
        self._exchanges = (
            ThreadPoolExecutor(1, thread_name_prefix="diloco-exchange") if spec.overlap else None
        )
        self._in_flight: dict[int, tuple[int, list[torch.Tensor], Future[None]]] = {}

    def after(
        self, step: int, syncing: Sequence[int], inner: Sequence[torch.optim.Optimizer]
    ) -> None:
        """After global step ``step`` (from 0): land the exchanges due now (started ``overlap``
        steps ago), then synchronise the fragments ``syncing`` — their exchange started, to
        land ``overlap`` steps on, or done now (no overlap, or a blocking step: every exchange
        in flight lands first).

        Raises:
            RuntimeError: the group broke (torch.distributed's own error).
        """
        done = step + 1
        closing = done in self.closing
        for p, (due, deltas, exchange) in sorted(self._in_flight.items()):
            if closing or due == done:
                del self._in_flight[p]
                exchange.result()
                self.fragments[p].land(deltas, inner, 0.0 if closing else self.spec.mixing)
        for p in syncing:
            fragment = self.fragments[p]
            deltas = fragment.deltas()
            if self._exchanges is not None and not closing:
                exchange = self._exchanges.submit(fragment.exchange, deltas)
                self._in_flight[p] = (done + self.spec.overlap, deltas, exchange)
            else:
                fragment.exchange(deltas)
                fragment.land(deltas, inner, 0.0 if closing else self.spec.mixing)

    def momenta(self) -> list[torch.Tensor | None]:
        """The outer momentum of each parameter, in order (``None`` where there is none yet:
        before the first synchronisation, or without momentum). A parameter cut between
        fragments of which some synchronised has zeros where the others would have theirs
        (what torch's SGD, without dampening, steps alike: its first buffer is the
        gradient)."""
        parts: dict[int, list[tuple[int, int, torch.Tensor | None]]] = defaultdict(list)
        for fragment in self.fragments:
            for (k, start, stop), buffer in zip(fragment.pieces, fragment.momenta(), strict=True):
                parts[k].append((start, stop, buffer))
        held: list[torch.Tensor | None] = []
        for k, param in enumerate(self.params):
            pieces = sorted(parts[k], key=lambda part: part[0])
            if all(buffer is None for _, _, buffer in pieces):
                held.append(None)
                continue
            flat = [
                torch.zeros(stop - start, dtype=param.dtype, device=param.device)
                if buffer is None
                else buffer
                for start, stop, buffer in pieces
            ]
            held.append(torch.cat(flat).view_as(param))
        return held

    def load_momenta(self, momenta: Sequence[torch.Tensor | None]) -> None:
        """Set the outer momentum of each parameter, in order, as :meth:`momenta` gives it (a
        replica joining at a synchronisation, a run resumed)."""
        flat = [None if momentum is None else momentum.reshape(-1) for momentum in momenta]
        for fragment in self.fragments:
            fragment.load_momenta(
                [
                    None if (values := flat[k]) is None else values[start:stop]
                    for k, start, stop in fragment.pieces
                ]
            )

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """The model's weights set to the global weights while the block runs (the global
        model, read where a Streaming DiLoCo run validates: every replica holds it alike,
        each fragment's as its last synchronisation that landed left it), then back to the
        local weights. Exchanges in flight touch neither."""
        local = [[v.clone() for v in fragment.local()] for fragment in self.fragments]
        try:
            with torch.no_grad():
                for fragment in self.fragments:
                    for v, g in zip(fragment.local(), fragment.global_params, strict=True):
                        v.copy_(g)
            yield
        finally:
            with torch.no_grad():
                for fragment, held in zip(self.fragments, local, strict=True):
                    for v, kept in zip(fragment.local(), held, strict=True):
                        v.copy_(kept)

    def close(self) -> None:
        """Stop the exchange thread (a plan replaced or the replica gone)."""
        if self._exchanges is not None:
            self._exchanges.shutdown(wait=False, cancel_futures=True)


class _Fragment:
    """Pieces of the model's parameters, in order, with their global weights, outer optimizer
    and compressed mean (its int8 residuals its own): one of Streaming DiLoCo's fragments, or
    the whole model with one (each piece then a whole parameter)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        pieces: list[Piece],
        spec: OuterStepSpec,
        compression: Compression | None,
    ) -> None:
        self.spec = spec
        self.pieces = pieces
        self.model = params
        self.params = [params[k] for k in dict.fromkeys(k for k, _, _ in pieces)]
        self.global_params = [v.clone() for v in self.local()]
        self.pseudo_gradients = CompressedMean(compression)
        nesterov = spec.nesterov and spec.momentum > 0  # Nesterov's step needs a momentum
        self.optimizer = torch.optim.SGD(
            self.global_params, lr=spec.lr, momentum=spec.momentum, nesterov=nesterov
        )

    def local(self) -> list[torch.Tensor]:
        """The local weights of each piece, as they stand (views, written through)."""
        return [_values(self.model[k], start, stop) for k, start, stop in self.pieces]

    def deltas(self) -> list[torch.Tensor]:
        """This replica's pseudo-gradients now: global weights − local weights."""
        with torch.no_grad():
            return [g - v for g, v in zip(self.global_params, self.local(), strict=True)]

    def momenta(self) -> list[torch.Tensor | None]:
        """Each piece's outer momentum buffer (torch SGD's), or ``None``."""
        state = self.optimizer.state
        return [state.get(g, {}).get("momentum_buffer") for g in self.global_params]

    def load_momenta(self, momenta: Sequence[torch.Tensor | None]) -> None:
        """Each piece's outer momentum buffer set (or dropped, for ``None``)."""
        for g, momentum in zip(self.global_params, momenta, strict=True):
            if momentum is None:
                self.optimizer.state.pop(g, None)
            else:
                buffer = momentum.detach().reshape(g.shape).to(g.device, g.dtype, copy=True)
                self.optimizer.state[g] = {"momentum_buffer": buffer}

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        """Replace ``deltas`` by their mean over the group, in buckets (on the exchange thread
        when it overlaps inner steps: it touches nothing else). When the group breaks, the
        int8 residuals are as they were: the exchange can be made again, in a group formed
        anew."""
        before = dict(self.pseudo_gradients.residuals)
        try:
            self._exchange(deltas)
        except RuntimeError:
            self.pseudo_gradients.residuals = before
            raise

    def _exchange(self, deltas: list[torch.Tensor]) -> None:
        with torch.no_grad():
            sizes = [d.numel() * d.element_size() for d in deltas]
            for k, run in enumerate(buckets(sizes)):  # (protocol.rules.traffic counts them so)
                bucket = [deltas[j] for j in run]
                flat = torch.cat([d.reshape(-1) for d in bucket])
                self.pseudo_gradients.mean(flat, k)
                offset = 0
                for d in bucket:
                    d.copy_(flat[offset : offset + d.numel()].view_as(d))
                    offset += d.numel()

    def land(
        self, mean: list[torch.Tensor], inner: Sequence[torch.optim.Optimizer], alpha: float
    ) -> None:
        """The outer step on the global weights with the mean pseudo-gradients ``mean``, then
        the local weights set to them — or, mixing, to ``alpha``·local + (1 − ``alpha``)·global
        (local having trained on meanwhile; a blocking synchronisation does not mix: every
        replica then holds the global model); the ``inner`` optimizers' state of these
        parameters dropped when the spec says so."""
        with torch.no_grad():
            for g, delta in zip(self.global_params, mean, strict=True):
                g.grad = delta
            self.optimizer.step()
            for g, v in zip(self.global_params, self.local(), strict=True):
                if alpha:
                    v.lerp_(g, 1.0 - alpha)
                else:
                    v.copy_(g)
                g.grad = None
        if self.spec.inner_state == "reset":  # (of every parameter a piece of it holds)
            for optimizer in inner:
                for p in self.params:
                    optimizer.state.pop(p, None)


def _values(param: torch.nn.Parameter, start: int, stop: int) -> torch.Tensor:
    """Values ``[start, stop)`` of ``param``, flattened: a view of it (written through), or
    the parameter itself when the piece is all of it (so a whole parameter keeps its shape,
    and one fragment is DiLoCo's own step, tensor for tensor).

    Raises:
        EngineError: ``BAD_REQUEST`` for a parameter cut between fragments that is not
            contiguous in memory (a view of its values could not be written through).
    """
    values = param.detach()
    if start == 0 and stop == param.numel():
        return values
    if not values.is_contiguous():
        raise EngineError(
            ErrorCode.BAD_REQUEST,
            f"Streaming DiLoCo: a parameter of shape {list(param.shape)} cut between fragments "
            "is not contiguous in memory",
        )
    return values.view(-1)[start:stop]


class SyncPoint:
    """A replica ``alone``: the weights ``params`` (node → name → parameter) had at its last
    synchronisation, its pseudo-gradients from them, and the coordinator's outer update onto
    them (module docstring)."""

    def __init__(self, params: dict[str, dict[str, torch.nn.Parameter]]) -> None:
        self.params = params
        self.anchor = {
            node: {name: p.detach().clone() for name, p in named.items()}
            for node, named in params.items()
        }
        self._sent: TreeCompressor | None = None

    def pseudo_gradients(self, compression: Compression) -> dict[str, object]:
        """θ_sync − θ_now, as ``compression`` has it travel (int8: the residual of the last
        synchronisation added, this one's kept)."""
        if self._sent is None or self._sent.compression != compression:
            self._sent = TreeCompressor(compression)
        with torch.no_grad():
            deltas = {
                node: {name: self.anchor[node][name] - p.detach() for name, p in named.items()}
                for node, named in self.params.items()
            }
        return self._sent.encode(deltas)

    def update(self, message: dict[str, object]) -> None:
        """Add the coordinator's outer update (compressed) to the weights of the last
        synchronisation; the weights become them.

        Raises:
            EngineError: ``BAD_REQUEST`` for an update that cannot be decoded,
                ``GRADIENT_MISMATCH`` for one that is not of this model's parameters.
        """
        try:
            update = decode(message)
        except BadCompressedTree as exc:
            raise EngineError(ErrorCode.BAD_REQUEST, f"an outer update: {exc}") from exc
        expected = {(n, k): tuple(p.shape) for n, ps in self.params.items() for k, p in ps.items()}
        given = {(n, k): tuple(t.shape) for n, ts in update.items() for k, t in ts.items()}
        if given != expected:
            raise EngineError(
                ErrorCode.GRADIENT_MISMATCH,
                "an outer update must hold every trainable parameter of the replica, in its "
                f"shape: expected {sorted(expected)}, got {sorted(given)}",
            )
        with torch.no_grad():
            for node, named in self.params.items():
                for name, p in named.items():
                    anchor = self.anchor[node][name]
                    anchor.add_(update[node][name].to(anchor.device, anchor.dtype))
                    p.copy_(anchor)
