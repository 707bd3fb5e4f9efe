"""Issue 15: a daemon training over a dataset much larger than itself holds a step of it, not
all of it.

A live worker serves a 2 GiB ``x.npy`` (8,192 rows of 65,536 float32); a DataParallel job, then
a Local one (the training loop FedAvg's clients run too), train an epoch over all of it in
batches of 128 rows (32 MiB). Each job daemon's peak resident size
(``VmHWM``, read from ``/proc`` while the job runs) stays a fraction of the dataset: its rows are
read a step at a time and released (:class:`engine.data.npy_rows.NpyRows`), never mapped or read
whole. The model is checked against a plain torch loop over the same rows.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import cluster
from tests.integration.strategies.test_data_parallel_live import daemons_of
from tests.utils import UNIT

pytestmark = pytest.mark.integration

ROWS, COLS, BATCH = 8192, 65536, 128
"""2 GiB of float32 rows, 64 steps of 32 MiB."""


def _peak_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    peaks = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")]
    return peaks[0] if peaks else 0  # a zombie has none


def test_a_daemon_training_over_2_gib_of_rows_holds_a_small_part_of_them(tmp_path):
    data = tmp_path / "big"
    data.mkdir()
    x = np.lib.format.open_memmap(data / "x.npy", mode="w+", dtype=np.float32, shape=(ROWS, COLS))
    row_values = np.linspace(-1, 1, ROWS, dtype=np.float32)
    for lo in range(0, ROWS, 512):
        x[lo : lo + 512] = row_values[lo : lo + 512, None] * np.cos(np.arange(COLS) / 97.0)
    x.flush()
    del x
    y = (np.arange(ROWS) % 3 == 0).astype(np.int64)
    np.save(data / "y.npy", y)

    torch.manual_seed(0)
    module = torch.nn.Linear(COLS, 2)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    net = sz.TorchFilter(
        module,
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.1,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
    )
    peaks: dict[int, int] = {}
    done = threading.Event()
    with cluster(tmp_path, {"w1": ()}, data={"w1": {"big": data}}) as c, c.client() as client:
        agent = c.workers["w1"]

        def watch() -> None:
            while not done.wait(0.05):
                try:
                    pids = daemons_of(agent)
                except OSError:  # a thread of the agent ended while it was read
                    continue
                for pid in pids:
                    peaks[pid] = max(peaks.get(pid, 0), _peak_kib(pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        graph = sz.Graph([net.named("lin")])
        strategy = sz.DataParallel(1, collective="torch")  # the replica's own training loop
        fitted = client.submit(graph, sz.WorkerData("big"), strategy=strategy).result(
            timeout=300 * UNIT
        )
        dp_peak = max(peaks.values(), default=0)
        peaks.clear()
        # Local's training loop (and FedAvg's) reads the rows a batch at a time too.
        local = client.submit(graph, sz.WorkerData("big"), strategy=sz.Local()).result(
            timeout=300 * UNIT
        )
        done.set()
        watcher.join()
        local_peak = max(peaks.values(), default=0)

    dataset_kib = ROWS * COLS * 4 // 1024
    for name, peak in (("DataParallel", dp_peak), ("Local", local_peak)):
        assert peak, f"no daemon was seen for {name}"
        assert peak * 4 < dataset_kib, f"{name}'s daemon peaked at {peak} KiB of {dataset_kib}"
        print(f"{name}: daemon peak VmHWM {peak / 1024:.0f} MiB over {dataset_kib >> 10} MiB")

    # The same epoch in a plain torch loop, over the file's rows.
    module.load_state_dict(start)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rows = np.load(data / "x.npy", mmap_mode="r")
    for lo in range(0, ROWS, BATCH):
        opt.zero_grad()
        xb = torch.from_numpy(np.array(rows[lo : lo + BATCH]))
        torch.nn.functional.cross_entropy(
            module(xb), torch.from_numpy(y[lo : lo + BATCH])
        ).backward()
        opt.step()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(fitted.states["lin"][key], value, rtol=0, atol=1e-5)
        torch.testing.assert_close(local.states["lin"][key], value, rtol=0, atol=1e-5)
