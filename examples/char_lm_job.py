"""A character-level language model on the Python standard library's own sources, written as a
user writes one: a transformer that returns ``(batch, time, vocab)`` logits, trained on
windows of 128 bytes to predict each next byte with AdamW, a cosine schedule and clipping.

Train it in this process::

    python examples/char_lm_job.py

or on two workers of a running coordinator (its validation loss in the job's history)::

    somatize submit examples/char_lm_job.py

``CHAR_LM_ROWS`` sets the training windows (default 8,192); ``python -m benchmarks.own_model``
trains this very file three ways (one process, ``sz.DataParallel(2)``, torchrun-style DDP) and
sets their times and losses side by side.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

import somatize as sz

CONTEXT, WIDTH, LAYERS, HEADS, VOCAB = 128, 192, 3, 4, 128
ROWS = int(os.environ.get("CHAR_LM_ROWS", "8192"))
VAL_ROWS, BATCH, EPOCHS, SEED = 1024, 64, 1, 0


def text_ids(max_bytes: int = 4_700_000) -> np.ndarray:
    """The standard library's ``.py`` files, sorted and joined, as byte ids (ASCII; any other
    byte is 127)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "-packages" not in str(p.relative_to(root)))
    data = bytearray()
    for path in files:
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return np.minimum(np.frombuffer(bytes(data[:max_bytes]), np.uint8), 127).astype(np.int64)


def windows(ids: np.ndarray, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` windows at seeded offsets: the inputs and, one byte on, the targets."""
    offsets = np.random.default_rng(seed).integers(0, len(ids) - CONTEXT - 1, size=rows)
    index = offsets[:, None] + np.arange(CONTEXT)
    return ids[index], ids[index + 1]


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training windows from the first 90 % of the text, validation ones from the rest."""
    ids = text_ids()
    cut = int(len(ids) * 0.9)
    return (*windows(ids[:cut], ROWS, SEED), *windows(ids[cut:], VAL_ROWS, SEED + 1))


class CharModel(torch.nn.Module):
    """Byte and position embeddings, a causal pre-norm transformer, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.embed(ids) + self.position[:t]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.head(self.norm(h))  # (batch, time, vocab)


def make_model() -> CharModel:
    torch.manual_seed(SEED)
    return CharModel()


def make_graph() -> sz.Graph:
    net = sz.TorchFilter(
        make_model(),
        loss="cross_entropy",  # sequence logits against (batch, time) targets
        optimizer="adamw",
        lr=3e-3,
        batch_size=BATCH,
        epochs=EPOCHS,
        scheduler="cosine",
        clip_grad_norm=1.0,
        seed=SEED,
    )
    return sz.Graph([net.named("char_lm")])


x, y, x_val, y_val = data()
graph = make_graph()
validation = (x_val, y_val)
strategy = sz.DataParallel(2)
name = "char-lm"

if __name__ == "__main__":
    fitted = graph.fit(x, y, validation=validation)
    print(f"validation loss {fitted.history[-1]['val_loss']:.4f} after {EPOCHS} epoch(s)")
