"""The workload of :mod:`benchmarks.slow_links`: a character-level transformer language model on
the Python standard library's own sources.

The same arrays and the same seeded model feed the anchors (:mod:`benchmarks.slow_links.anchors`:
torch DDP, DDP + PowerSGD, a hand-written DiLoCo) and the project's ``sz.DataParallel`` /
``sz.DiLoCo`` jobs, so their validation losses can be set side by side.

* The text (:func:`corpus`): every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``
  (``site-packages`` / ``dist-packages`` left out: they differ from machine to machine), sorted
  by their path relative to it, read as bytes and concatenated, cut at ``max_bytes``.
* The vocabulary (:data:`VOCAB`): newline, tab and the 95 printable ASCII characters, then one
  id (:data:`UNKNOWN`) for every other byte — :data:`VOCAB_SIZE` ids in all.
* The rows (:func:`windows`, :func:`train_and_validation`): windows of ``context`` tokens at
  seeded random offsets, each target the next token; training windows from the first 90 % of
  the tokens, validation windows from the last 10 %, so none overlaps.
* The model (:class:`CharLM`, :func:`model`): token and learned position embeddings, a pre-norm
  causal ``torch.nn.TransformerEncoder`` (GELU, no dropout, so a run is deterministic), a final
  LayerNorm and a linear head. Its logits come out as ``(batch, vocab, time)``, the layout
  ``F.cross_entropy(logits, y)`` takes with ``y`` of shape ``(batch, time)``: a
  ``TorchFilter(model(), loss="cross_entropy")`` trains it as it is.

The default size (:data:`SIZE`: d_model 256, 4 layers, 4 heads, feed-forward 1024, context 64)
has 3,226,210 parameters, 12.9 MB of float32 gradients: a ring all-reduce puts 12.9 MB (2
workers) or 19.4 MB (4) of each worker's on a 100 Mbit/s link, 1.0 s or 1.5 s, while a forward,
backward and AdamW step of 16 or 32 rows takes about 0.3 s or 0.6 s on one CPU thread —
communication dominates, which is what the benchmark is about (``python -m
benchmarks.slow_links.char_lm`` prints the size, the step times and a short run's validation loss).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "CONTEXT",
    "CORPUS_BYTES",
    "SIZE",
    "UNKNOWN",
    "VOCAB",
    "VOCAB_SIZE",
    "CharLM",
    "Size",
    "corpus",
    "decode",
    "encode",
    "model",
    "parameter_count",
    "train_and_validation",
    "windows",
]

VOCAB = "\n\t" + "".join(chr(c) for c in range(32, 127))
"""The characters with an id of their own: id ``i`` is ``VOCAB[i]``."""
UNKNOWN = len(VOCAB)
"""The id of every byte not in :data:`VOCAB` (other control bytes, UTF-8's non-ASCII bytes)."""
VOCAB_SIZE = len(VOCAB) + 1
"""98 ids: :data:`VOCAB` and :data:`UNKNOWN`."""

_IDS = np.full(256, UNKNOWN, dtype=np.int64)
_IDS[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))

CONTEXT = 64
"""Tokens per window at the benchmark's size."""
CORPUS_BYTES = 8 << 20
"""Bytes of the standard library the benchmark reads (the first 8 MiB, in path order)."""
VALIDATION_FRACTION = 0.1
"""The tail of the tokens the validation windows come from."""
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def encode(data: bytes) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``data``'s bytes as token ids (int64)."""
    return _IDS[np.frombuffer(data, dtype=np.uint8)]


def decode(ids: np.ndarray[Any, Any]) -> str:
    """Token ids back to text; :data:`UNKNOWN` shows as ``"\\ufffd"``."""
    return "".join(VOCAB[i] if i < UNKNOWN else "\ufffd" for i in np.asarray(ids).tolist())


def _sources(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside installed packages, sorted by relative path."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus(max_bytes: int = CORPUS_BYTES) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The first ``max_bytes`` of the standard library's sources (module docstring) as token
    ids: the same on every machine with the same Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in _sources(root):
        if size >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
    return encode(b"".join(chunks))


def windows(
    tokens: np.ndarray[Any, Any], context: int, rows: int, seed: int
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
    """``rows`` windows of ``tokens`` at offsets drawn by ``numpy.random.default_rng(seed)``:
    inputs ``x`` and targets ``y``, both ``(rows, context)`` int64, ``y[:, t] = x[:, t + 1]``
    (the next token, also past the window's end).

    Raises:
        ValueError: ``tokens`` shorter than one window and its next token.
    """
    if len(tokens) < context + 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {context} + 1")
    offsets = np.random.default_rng(seed).integers(0, len(tokens) - context, size=rows)
    index = offsets[:, None] + np.arange(context)
    tokens = np.asarray(tokens, dtype=np.int64)
    return tokens[index], tokens[index + 1]


def train_and_validation(
    rows: int,
    val_rows: int,
    seed: int,
    context: int = CONTEXT,
    max_bytes: int = CORPUS_BYTES,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(x, y, val_x, val_y)``: ``rows`` training windows from the first 90 % of
    :func:`corpus`'s tokens (offsets seeded by ``seed``) and ``val_rows`` validation windows
    from the last 10 % (seeded by ``seed + 1``): disjoint text, the same arrays for the same
    arguments."""
    tokens = corpus(max_bytes)
    cut = int(len(tokens) * (1 - VALIDATION_FRACTION))
    x, y = windows(tokens[:cut], context, rows, seed)
    val_x, val_y = windows(tokens[cut:], context, val_rows, seed + 1)
    return x, y, val_x, val_y


@dataclass(frozen=True)
class Size:
    """A :class:`CharLM`'s shape."""

    d_model: int = 256
    layers: int = 4
    heads: int = 4
    ff: int = 1024
    context: int = CONTEXT
    vocab: int = VOCAB_SIZE


SIZE = Size()
"""The benchmark's model: 3,226,210 parameters (12.9 MB of float32)."""


class CharLM(torch.nn.Module):
    """A decoder-only transformer over characters (module docstring): ``(B, T)`` token ids in,
    ``(B, V, T)`` next-token logits out, position ``t`` seeing tokens ``0..t`` only."""

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        context: int = CONTEXT,
        d_model: int = 256,
        layers: int = 4,
        heads: int = 4,
        ff: int = 1024,
    ) -> None:
        super().__init__()
        self.context = context
        self.tokens = torch.nn.Embedding(vocab, d_model)
        self.positions = torch.nn.Embedding(context, d_model)
        # GPT-2's embedding init (std 0.02): unit-variance embeddings would swamp the residual
        torch.nn.init.normal_(self.tokens.weight, std=0.02)
        torch.nn.init.normal_(self.positions.weight, std=0.02)
        layer = torch.nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=ff,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # nested tensors need post-norm layers; saying so keeps torch from warning about it
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, V, T)`` of the token after each of ``x``'s ``(B, T)`` (``T`` at most
        the context)."""
        steps = x.shape[1]
        where = torch.arange(steps, device=x.device)
        h = self.tokens(x) + self.positions(where)
        # made here, not held as a buffer: DDP would broadcast a buffer before every forward
        mask = torch.nn.Transformer.generate_square_subsequent_mask(steps, device=x.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits.transpose(1, 2)


def model(seed: int = 0, size: Size = SIZE) -> CharLM:
    """The benchmark's :class:`CharLM`, its weights drawn after ``torch.manual_seed(seed)``:
    the same on every process for the same ``seed``."""
    torch.manual_seed(seed)
    return CharLM(**asdict(size))


def parameter_count(module: torch.nn.Module) -> int:
    """How many numbers ``module``'s parameters hold."""
    return sum(p.numel() for p in module.parameters())


def loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``module`` on ``x`` against ``y`` (what a
    ``TorchFilter(loss="cross_entropy")`` computes)."""
    return F.cross_entropy(module(x), y)


@torch.no_grad()
def evaluate(
    module: torch.nn.Module, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], batch: int = 256
) -> float:
    """Mean cross-entropy over every token of ``x``'s rows (eval mode, no gradient, in batches
    of ``batch`` rows); ``module`` is left in the mode it was in."""
    was_training = module.training
    module.eval()
    total = 0.0
    try:
        for start in range(0, len(x), batch):
            xb = torch.from_numpy(x[start : start + batch])
            yb = torch.from_numpy(y[start : start + batch])
            total += float(F.cross_entropy(module(xb), yb, reduction="sum"))
    finally:
        module.train(was_training)
    return total / y.size


def _measure(seed: int = 0) -> None:  # pragma: no cover - a print-out, run by hand
    """Print the default model's size, its step time at 16 and 32 rows on one thread, and a
    short training run's validation loss."""
    import time

    torch.set_num_threads(1)
    lm = model(seed)
    n = parameter_count(lm)
    print(f"parameters {n:,}  gradient {n * 4 / 1e6:.1f} MB  (vocab {VOCAB_SIZE})")
    x, y, vx, vy = train_and_validation(rows=6400, val_rows=512, seed=seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    for rows in (16, 32):
        times = []
        for k in range(8):
            window = slice(k * rows, (k + 1) * rows)
            xb, yb = torch.from_numpy(x[window]), torch.from_numpy(y[window])
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss(lm, xb, yb).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        print(f"step of {rows} rows, 1 thread: median {sorted(times[2:])[3] * 1e3:.0f} ms")
    lm = model(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    print(f"val loss at 0: {evaluate(lm, vx, vy):.3f}")
    for step in range(200):
        rows_ = slice(step * 32, (step + 1) * 32)
        opt.zero_grad(set_to_none=True)
        loss(lm, torch.from_numpy(x[rows_]), torch.from_numpy(y[rows_])).backward()
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"val loss at {step + 1}: {evaluate(lm, vx, vy):.3f}")


if __name__ == "__main__":  # pragma: no cover
    _measure()
