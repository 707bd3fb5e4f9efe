"""A GPT-2 on the Python standard library's own sources, written as a Hugging Face user writes
one: a byte-level BPE tokenizer of its own (the ``tokenizers`` library, trained here on the
sources), a ``transformers.GPT2LMHeadModel`` built from a config (nothing downloaded) that
computes its own loss (``loss="model"``), windows of 128 tokens in a ``datasets.Dataset``,
AdamW with transformers' warmup-then-cosine schedule, gradients clipped to 1.0, a fixed number
of steps and a validation every 100 of them.

Train it in this process::

    python examples/gpt2_job.py

or on two workers of a running coordinator (its validations in the job's history)::

    somatize submit examples/gpt2_job.py

``GPT2_STEPS`` sets the optimizer steps (default 300), ``GPT2_ROWS`` the training windows
(default as many as the steps take, one epoch; given alone, one epoch over them; fewer than the
steps take, and they run over several epochs, ``max_steps`` stopping the last one),
``GPT2_VAL_ROWS`` the validation windows (default 256) and ``GPT2_VALIDATE_EVERY`` how often
they are evaluated (default every 100 steps, and at each epoch's end). The tokenizer and the
token ids are kept in the system's temporary directory under a hash of what made them (the
sources, the vocabulary, the ``tokenizers`` version): a second load reads them back.
``python -m benchmarks.own_model`` trains this very file with ``sz.DataParallel(2)`` (through
``sz.connect`` and through ``somatize submit``) and with torchrun's DDP, and sets their times,
memory and validation losses side by side.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import somatize as sz

CONTEXT, WIDTH, LAYERS, HEADS, VOCAB = 128, 256, 4, 4, 4096
BATCH, LR, WEIGHT_DECAY, SEED = 64, 2e-3, 0.1, 0
_ROWS = os.environ.get("GPT2_ROWS")
STEPS = int(os.environ.get("GPT2_STEPS") or (max(1, int(_ROWS) // BATCH) if _ROWS else 300))
ROWS = int(_ROWS or STEPS * BATCH)
VAL_ROWS = int(os.environ.get("GPT2_VAL_ROWS", "256"))
VALIDATE_EVERY = int(os.environ.get("GPT2_VALIDATE_EVERY", "100"))
WARMUP = max(1, STEPS // 10)
EPOCHS = -(-STEPS * BATCH // ROWS)  # enough passes over the rows for the steps
END = "<|endoftext|>"
CACHE = Path(tempfile.gettempdir()) / "somatize-gpt2-job"


def sources(max_chars: int = 4_700_000) -> list[str]:
    """The standard library's ``.py`` files, sorted, as text (about 1.2 M tokens)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "-packages" not in str(p.relative_to(root)))
    texts, size = [], 0
    for path in files:
        texts.append(path.read_bytes().decode("utf-8", errors="replace"))
        size += len(texts[-1])
        if size >= max_chars:
            break
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """GPT-2's kind of tokenizer: BPE merges over bytes (no unknown token), ``VOCAB`` ids, the
    last of them ``<|endoftext|>``. The trainer breaks ties between equal counts by the pair
    itself, so the same texts give the same merges whatever the threads."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenized() -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """The tokenizer, trained on the first 90 % of the files, and the token ids of those files
    and of the rest, each file followed by ``<|endoftext|>``; read back from the cache when
    the same sources, vocabulary and ``tokenizers`` made them before."""
    texts = sources()
    cut = int(len(texts) * 0.9)
    digest = hashlib.sha256(f"{tokenizers.__version__} {VOCAB} {cut}".encode())
    for text in texts:
        digest.update(text.encode())
    stem = CACHE / digest.hexdigest()[:24]
    saved, ids = stem.with_suffix(".json"), stem.with_suffix(".npz")
    if saved.exists() and ids.exists():
        with np.load(ids) as arrays:
            return Tokenizer.from_file(str(saved)), arrays["train"], arrays["val"]
    tokenizer = train_tokenizer(texts[:cut])
    end = tokenizer.token_to_id(END)
    encoded = [np.array([*e.ids, end]) for e in tokenizer.encode_batch_fast(texts)]
    train, val = np.concatenate(encoded[:cut]), np.concatenate(encoded[cut:])
    CACHE.mkdir(exist_ok=True)
    # Written aside and renamed: a process reading the cache meanwhile sees both or neither.
    partial = f".{os.getpid()}.partial"
    tokenizer.save(str(saved) + partial)
    with open(str(ids) + partial, "wb") as out:
        np.savez(out, train=train, val=val)
    os.replace(str(ids) + partial, ids)
    os.replace(str(saved) + partial, saved)
    return tokenizer, train, val


def windows(ids: np.ndarray, rows: int, seed: int) -> Dataset:
    """``rows`` windows of ``CONTEXT`` tokens at seeded offsets, as the model takes them: its
    ``input_ids``, and the same ids as ``labels`` (GPT-2 shifts them to score each next
    token)."""
    offsets = np.random.default_rng(seed).integers(0, len(ids) - CONTEXT, size=rows)
    window = ids[offsets[:, None] + np.arange(CONTEXT)]
    return Dataset.from_dict({"input_ids": window, "labels": window}).with_format("torch")


def make_model(vocab: int) -> transformers.GPT2LMHeadModel:
    """A 4-layer GPT-2 of width 256 (4.2 M parameters, the output layer tied to the token
    embeddings), seeded. No dropout: every replica then computes what one process would."""
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=CONTEXT,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(SEED)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what it computes; transformers warns when it must guess
    return model


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)


def warmup_cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first tenth of the steps, then cosine down to zero at the last."""
    return transformers.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)


tokenizer, train_ids, val_ids = tokenized()
x = windows(train_ids, ROWS, SEED)
validation = windows(val_ids, VAL_ROWS, SEED + 1)
gpt2 = sz.TorchFilter(
    make_model(tokenizer.get_vocab_size()),
    loss="model",  # GPT-2 returns its loss given labels
    optimizer=adamw,
    scheduler=warmup_cosine,
    batch_size=BATCH,
    epochs=EPOCHS,
    clip_grad_norm=1.0,
    seed=SEED,
    max_steps=STEPS,
    validate_every=VALIDATE_EVERY,
)
graph = sz.Graph([gpt2.named("gpt2")])
strategy = sz.DataParallel(2)
name = "gpt2"

if __name__ == "__main__":
    fitted = graph.fit(x, validation=validation)
    for row in fitted.validations:
        print(f"step {row['step']}: validation loss {row['val_loss']:.4f}")
    print(f"validation loss {fitted.history[-1]['val_loss']:.4f} after {STEPS} steps")
