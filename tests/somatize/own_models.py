"""Models as users write them, and plain torch loops that train them: a dict batch (ids + mask
-> logits), a module of two tensors, a model that computes its own loss, a ``step`` function
with a masked loss and a metric. Shared by the in-process and the distributed tests (pickled by
value: this is the user's own code)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB, WIDTH, CLASSES, LENGTH = 17, 8, 3, 6


def token_rows(n: int = 150, seed: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``({"ids", "mask"}, labels)``: sequences of ``LENGTH`` tokens, some padded (mask 0), a
    class per row that depends on the unmasked tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(n, LENGTH)).astype(np.int64)
    lengths = rng.integers(2, LENGTH + 1, size=n)
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.float32)
    ids = np.where(mask > 0, ids, 0)
    y = ((ids * mask).sum(1) % CLASSES).astype(np.int64)
    return {"ids": ids, "mask": mask}, y


class MaskedPool(torch.nn.Module):
    """``forward(ids, mask) -> logits``: embeddings averaged over the unmasked tokens."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        summed = (self.embed(ids) * mask.unsqueeze(-1)).sum(1)
        return self.head(torch.tanh(summed / mask.sum(1, keepdim=True)))


class TokenTagger(torch.nn.Module):
    """``forward(ids) -> (B, T, VOCAB)`` logits: a per-token model for masked losses."""

    def __init__(self, seed: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(ids)))


class SelfScoring(torch.nn.Module):
    """A model that computes its own loss, as a Hugging Face model does given ``labels``:
    ``forward(ids, mask, labels) -> {"loss", "logits"}``."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        self.inner = MaskedPool(seed)

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        logits = self.inner(ids, mask)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def masked_token_step(model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A ``step=`` function: next-token cross-entropy over the unmasked positions, each row's
    mean over its tokens then the batch's mean over rows (a mean over rows, so data-parallel
    replicas average to it); the token accuracy as a metric, a mean over rows too."""
    ids, mask = batch["ids"], batch["mask"]
    logits = model(ids[:, :-1])
    target, weight = ids[:, 1:], mask[:, 1:]
    each = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    per_row = (each * weight).sum(1) / weight.sum(1).clamp(min=1)
    hits = ((logits.argmax(-1) == target).float() * weight).sum(1) / weight.sum(1).clamp(min=1)
    return per_row.mean(), {"token_accuracy": hits.mean()}


def plain_loop(
    model: torch.nn.Module,
    x: dict[str, np.ndarray] | tuple[np.ndarray, ...],
    y: np.ndarray | None,
    loss_of: Callable[[torch.nn.Module, Any, Any], Any],
    *,
    epochs: int = 2,
    batch_size: int = 16,
    lr: float = 0.1,
    seed: int = 7,
) -> tuple[torch.nn.Module, list[dict[str, float]]]:
    """SGD with momentum 0.9 over shuffled batches (one ``torch.randperm`` per epoch from a
    generator seeded with ``seed``): each row of the history the epoch's mean loss and the mean
    of each metric ``loss_of`` returns, weighted by rows."""
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if isinstance(x, dict):
        xt: Any = {k: torch.as_tensor(v) for k, v in x.items()}
        n = len(next(iter(x.values())))
    else:
        xt = tuple(torch.as_tensor(v) for v in x)
        n = len(x[0])
    yt = None if y is None else torch.as_tensor(y)
    order = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        sums: dict[str, float] = {}
        for start in range(0, n, batch_size):
            b = perm[start : start + batch_size]
            xb = {k: v[b] for k, v in xt.items()} if isinstance(xt, dict) else [v[b] for v in xt]
            yb = None if yt is None else yt[b]
            opt.zero_grad()
            loss, metrics = loss_of(net, xb, yb)
            loss.backward()
            opt.step()
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float(torch.as_tensor(value).detach()) * len(b)
        history.append({name: total / n for name, total in sums.items()})
    return net, history
