"""benchmarks.slow_links.char_lm, the workload of benchmarks.slow_links: its vocabulary, windows
and model."""

from __future__ import annotations

import cloudpickle
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.slow_links import char_lm
from benchmarks.slow_links.anchors import powersgd_bytes
from protocol.options.compression import Compression
from protocol.rules.traffic import step_bytes

TINY = char_lm.Size(d_model=32, layers=1, heads=2, ff=64, context=16)


def test_every_byte_has_an_id_and_the_vocabulary_round_trips() -> None:
    ids = char_lm.encode(bytes(range(256)))
    assert ids.dtype == np.int64 and ids.shape == (256,)
    assert ids.min() == 0 and ids.max() == char_lm.UNKNOWN == char_lm.VOCAB_SIZE - 1
    known = [b for b in range(256) if chr(b) in char_lm.VOCAB]
    assert len(known) == len(char_lm.VOCAB) == 97  # newline, tab, the 95 printable characters
    assert char_lm.decode(ids[known]) == "".join(map(chr, known))
    assert all(ids[b] == char_lm.UNKNOWN for b in set(range(256)) - set(known))


def test_the_corpus_is_the_standard_library_cut_at_max_bytes() -> None:
    tokens = char_lm.corpus(10_000)
    assert tokens.dtype == np.int64 and tokens.shape == (10_000,)
    assert np.array_equal(tokens, char_lm.corpus(20_000)[:10_000])
    assert "import" in char_lm.decode(tokens)


def test_windows_are_seeded_and_their_targets_are_the_next_tokens() -> None:
    tokens = np.arange(1000, dtype=np.int64)  # each token its own offset
    x, y = char_lm.windows(tokens, context=8, rows=50, seed=3)
    assert x.shape == y.shape == (50, 8) and x.dtype == y.dtype == np.int64
    assert np.array_equal(y, x + 1)
    assert np.array_equal(x[:, 1:], x[:, :-1] + 1)  # contiguous text
    again, _ = char_lm.windows(tokens, context=8, rows=50, seed=3)
    assert np.array_equal(x, again)


def test_training_and_validation_windows_come_from_disjoint_text() -> None:
    data = char_lm.train_and_validation(64, 32, seed=0, context=8, max_bytes=20_000)
    x, y, val_x, val_y = data
    assert x.shape == y.shape == (64, 8) and val_x.shape == val_y.shape == (32, 8)
    tokens = char_lm.corpus(20_000)
    cut = int(len(tokens) * 0.9)
    train_text = char_lm.decode(tokens[:cut])
    assert all(char_lm.decode(row) in train_text for row in x[:8])
    assert all(char_lm.decode(row) in char_lm.decode(tokens[cut:]) for row in val_x[:8])


def test_the_default_model_has_its_stated_size_and_cross_entropy_takes_its_logits() -> None:
    model = char_lm.model(0)
    assert char_lm.parameter_count(model) == 3_226_210
    x = torch.randint(0, char_lm.VOCAB_SIZE, (2, char_lm.CONTEXT))
    logits = model(x)
    assert logits.shape == (2, char_lm.VOCAB_SIZE, char_lm.CONTEXT)
    loss = F.cross_entropy(logits, x).detach()
    assert 4.0 < float(loss) < 5.5  # about ln(98) = 4.58 at initialisation
    again = cloudpickle.loads(cloudpickle.dumps(model))  # as it is shipped to workers
    assert torch.equal(again(x), logits)


def test_the_model_is_causal_seeded_and_the_same_in_eval_mode() -> None:
    model = char_lm.model(1, TINY)
    x = torch.randint(0, char_lm.VOCAB_SIZE, (3, TINY.context))
    changed = x.clone()
    changed[:, -1] = (x[:, -1] + 1) % char_lm.VOCAB_SIZE
    out, out_changed = model(x), model(changed)
    assert torch.equal(out[..., :-1], out_changed[..., :-1])
    assert not torch.equal(out[..., -1], out_changed[..., -1])
    assert torch.equal(char_lm.model(1, TINY)(x), out)
    model.eval()
    with torch.no_grad():  # torch's fast path for inference: the same logits
        torch.testing.assert_close(model(x), out.detach(), rtol=1e-5, atol=1e-5)


def test_a_few_steps_of_adamw_lower_the_loss() -> None:
    torch.manual_seed(0)
    tokens = char_lm.corpus(20_000)
    x, y = (torch.from_numpy(a) for a in char_lm.windows(tokens, TINY.context, 32, seed=0))
    model = char_lm.model(0, TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad(set_to_none=True)
        loss = char_lm.loss(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0
    assert char_lm.evaluate(model, x.numpy(), y.numpy(), batch=10) < losses[0] - 1.0


def test_the_anchors_powersgd_bytes_are_the_projects() -> None:
    params = list(char_lm.model(0).parameters())
    shapes = [list(p.shape) for p in params]
    for rank in (1, 4, 32):
        assert powersgd_bytes(params, rank) == step_bytes(shapes, Compression(f"powersgd:{rank}"))
    assert step_bytes(shapes, None) == 4 * 3_226_210
