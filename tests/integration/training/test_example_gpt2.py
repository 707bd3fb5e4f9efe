"""Issue 56: ``examples/gpt2_job.py`` as its user runs it, ``somatize submit`` on two live
workers, made tiny through its environment: 3 steps over 80 windows (epochs of a 64-row and a
16-row batch, the second stopped by ``max_steps``), validated after every step (after step 1
between epoch ends). The job's history and validations are those of a plain torch loop written
here over the file's own windows and initial model: AdamW, transformers' warmup-then-cosine
schedule, clipping to 1.0, one seeded permutation an epoch cut in order."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import somatize as sz
from somatize.cli.curves import history_of, validations_of
from tests.integration.cluster import cluster
from tests.utils import somatize_cli

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).parents[3] / "examples" / "gpt2_job.py"
SIZES = {"GPT2_STEPS": "3", "GPT2_ROWS": "80", "GPT2_VAL_ROWS": "16", "GPT2_VALIDATE_EVERY": "1"}


def columns(dataset: Any) -> dict[str, torch.Tensor]:
    table = dataset.with_format("numpy")
    return {name: torch.as_tensor(np.asarray(table[name])) for name in dataset.column_names}


def plain_loop(job: dict[str, Any]) -> tuple[list[float], dict[int, float]]:
    """The job file's run by hand: each epoch's mean loss, and the validation loss after each
    step (1 is ``validate_every``'s, 2 ends an epoch, 3 the run)."""
    model = job["make_model"](job["tokenizer"].get_vocab_size())
    x, x_val = columns(job["x"]), columns(job["validation"])
    steps, batch = job["STEPS"], job["BATCH"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=job["LR"], betas=(0.9, 0.95), weight_decay=job["WEIGHT_DECAY"]
    )
    schedule = transformers.get_cosine_schedule_with_warmup(opt, job["WARMUP"], steps)
    order = torch.Generator().manual_seed(job["SEED"])
    rows = len(x["input_ids"])
    done, losses, scores = 0, [], {}
    while done < steps:
        perm = torch.randperm(rows, generator=order)
        total, seen = 0.0, 0
        for start in range(0, rows, batch):
            if done == steps:
                break
            b = perm[start : start + batch]
            model.train()
            loss = model(**{k: v[b] for k, v in x.items()}).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            done += 1
            total, seen = total + float(loss.detach()) * len(b), seen + len(b)
            model.eval()
            with torch.no_grad():
                scores[done] = float(model(**x_val).loss)  # 16 rows: one batch
        losses.append(total / seen)
    return losses, scores


def test_the_gpt2_example_trains_through_somatize_submit_as_its_plain_loop(tmp_path, monkeypatch):
    for name, value in SIZES.items():
        monkeypatch.setenv(name, value)
    job = runpy.run_path(str(EXAMPLE))
    assert job["EPOCHS"] == 3 and job["gpt2"].max_steps == 3  # max_steps ends the run
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c:
        submitted = somatize_cli(c.url, "submit", str(EXAMPLE), seconds=180)
        assert submitted.returncode == 0, submitted.stderr
        with sz.connect(c.url) as client:
            record = client.job(submitted.stdout.split()[0]).status()
    assert record["strategy"] == "data_parallel" and len(record["workers"]) == 2
    history, validations = history_of(record), validations_of(record)
    losses, scores = plain_loop(job)
    assert [row["epoch"] for row in history] == [1, 2]
    assert [row["loss"] for row in history] == pytest.approx(losses, abs=1e-5)
    assert [row["val_loss"] for row in history] == pytest.approx([scores[2], scores[3]], abs=1e-5)
    assert [(row["epoch"], row["step"]) for row in validations] == [(1, 1)]
    assert validations[0]["val_loss"] == pytest.approx(scores[1], abs=1e-5)
    assert scores[3] < scores[1]  # it learns
