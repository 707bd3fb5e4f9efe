"""Issue 15: a dataset opened by the job's own code, ``sz.WorkerData(name, loader=...)``.

A live worker serves a directory of text files (a format the project knows nothing of) as
``notes``: it announces it as a ``path`` of unknown rows. A job's loader, a
``torch.utils.data.Dataset`` defined here, opens it in the worker's daemon; Local trains on it
as a plain torch loop over the parsed rows does. A loader that raises fails the job with its
traceback, naming the dataset; the path without a loader is refused, saying a loader is needed.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

ROWS, D = 90, 5
EXAMPLE = Path(__file__).parents[3] / "examples" / "csv_loader_job.py"


class Notes(torch.utils.data.Dataset):
    """One ``(x, y)`` pair per ``*.txt`` file: D floats, then the class, space-separated."""

    def __init__(self, path: Path) -> None:
        self.files = sorted(Path(path).glob("*.txt"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        *x, y = self.files[i].read_text().split()
        return torch.tensor([float(v) for v in x]), int(y)


def broken_loader(path: Path):
    raise RuntimeError(f"cannot read {Path(path).name} on purpose")


def _write_tables(directory: Path) -> dict[str, Path]:
    """Each worker's CSV files for examples/csv_loader_job.py: 8 features, then the class."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(8, 3))
    out = {}
    for worker, files in (("w1", 2), ("w2", 3)):
        folder = directory / f"csv-{worker}"
        folder.mkdir()
        for f in range(files):
            x = rng.normal(size=(70, 8))
            table = np.column_stack([x, (x @ w).argmax(1)])
            np.savetxt(folder / f"part-{f}.csv", table, delimiter=",", header="features,class")
        out[worker] = folder
    return out


def _write_notes(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, D)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    directory.mkdir()
    for i in range(ROWS):
        words = [repr(float(v)) for v in x[i]] + [str(y[i])]
        (directory / f"note-{i:03d}.txt").write_text(" ".join(words))
    return x, y


def test_a_loader_opens_a_format_the_worker_does_not_know_and_local_trains_on_it(tmp_path):
    x, y = _write_notes(tmp_path / "notes")
    torch.manual_seed(0)
    module = torch.nn.Linear(D, 2)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    net = sz.TorchFilter(
        module,
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.1,
        batch_size=16,
        epochs=3,
        shuffle=False,
    )
    graph = sz.Graph([net.named("lin")])
    tables = _write_tables(tmp_path)
    data = {w: {"notes": tmp_path / "notes", "tabular": tables[w]} for w in tables}
    with (
        cluster(tmp_path, {"w1": ("dp",), "w2": ("dp",)}, data=data) as c,
        c.client() as client,
    ):
        notes = next(w for w in client.status()["workers"] if w["id"] == "w1")["datasets"]["notes"]
        assert (notes["kind"], notes["rows"], notes["x"]) == ("path", None, None)

        job = client.submit(graph, sz.WorkerData("notes", loader=Notes), strategy=sz.Local("w1"))
        fitted = job.result(timeout=60 * UNIT)

        broken = sz.WorkerData("notes", loader=broken_loader)
        with pytest.raises(sz.JobFailed) as failed:
            client.submit(graph, broken, strategy=sz.Local("w1")).result(timeout=60 * UNIT)
        error = failed.value
        assert error.code == "filter_error"
        assert "the loader of dataset 'notes' failed: RuntimeError: cannot read notes" in (
            error.message
        )
        assert "broken_loader" in (error.traceback or "")
        assert error.detail["worker_id"] == "w1"

        with pytest.raises(sz.JobFailed, match=r"sz\.WorkerData\(name, loader=make_dataset\)"):
            client.submit(graph, sz.WorkerData("notes"), strategy=sz.Local("w1")).result(
                timeout=60 * UNIT
            )

        # The example job file, as written: DataParallel over two workers' CSV files.
        example = runpy.run_path(str(EXAMPLE))
        csv_job = client.submit(example["graph"], example["x"], strategy=example["strategy"])
        csv_job.result(timeout=120 * UNIT)
        losses = [
            e.data["loss"]
            for e in csv_job.events(timeout=10 * UNIT)
            if e.data.get("phase") == "training" and "loss" in e.data
        ]
        assert sorted(csv_job.status()["workers"]) == ["w1", "w2"]
        assert losses[-1] < losses[0]

    module.load_state_dict(start)  # the same three epochs in a plain torch loop
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        for lo in range(0, ROWS, 16):
            opt.zero_grad()
            xb, yb = torch.from_numpy(x[lo : lo + 16]), torch.from_numpy(y[lo : lo + 16])
            torch.nn.functional.cross_entropy(module(xb), yb).backward()
            opt.step()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(fitted.states["lin"][key], value, rtol=0, atol=1e-6)
