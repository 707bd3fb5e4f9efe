"""A job on data the workers keep as CSV files, opened by the job's own loader.

Each worker serves a directory of ``*.csv`` files (a header line, then rows of features with
the class in the last column) under the name ``tabular``::

    somatize-worker --connect ws://COORDINATOR:8765 --tag dp --data tabular=/data/csv

and this file trains one model over all of them, each replica on its own worker's rows::

    somatize submit examples/csv_loader_job.py --coordinator ws://COORDINATOR:8765

``CsvRows`` runs inside each worker's filter daemon, on the path that worker was started with;
the client never names a path and never sees a row. Any format a ``torch.utils.data.Dataset``
can read works the same way.
"""

from pathlib import Path

import numpy as np
import torch

import somatize

FEATURES, CLASSES = 8, 3


class CsvRows(torch.utils.data.Dataset):
    """Every row of every ``*.csv`` file under ``path``, in file-name order: ``(x, y)``."""

    def __init__(self, path: Path) -> None:
        tables = [
            np.loadtxt(f, delimiter=",", skiprows=1, ndmin=2)
            for f in sorted(Path(path).glob("*.csv"))
        ]
        table = np.concatenate(tables) if tables else np.empty((0, FEATURES + 1))
        self.x = torch.as_tensor(table[:, :FEATURES], dtype=torch.float32)
        self.y = torch.as_tensor(table[:, FEATURES], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


graph = somatize.Graph(
    [
        somatize.TorchFilter(
            torch.nn.Sequential(
                torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
            ),
            loss="cross_entropy",
            optimizer="adam",
            lr=0.01,
            batch_size=64,  # per replica
            epochs=5,
            shuffle=True,
        ).named("mlp")
    ]
)
x = somatize.WorkerData("tabular", loader=CsvRows)
y = None
strategy = somatize.DataParallel(workers=2, tag="dp")
