"""Memory bounded by the batch, never the dataset: each case runs in a process of its own and
reports its peak resident memory (``VmHWM``), against a plain torch loop's in the same
test (issue 31: ``graph.fit`` once forwarded the whole training set and evaluated the whole
validation set in one call — 7.7 GB against the loop's 0.6 GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WINDOWS = """
import numpy as np, torch
rng = np.random.default_rng(0)
x_val = rng.integers(0, 64, size=(20000, 128)).astype(np.int64)
y_val = np.roll(x_val, -1, axis=1)
x, y = x_val[:4000], y_val[:4000]  # trained on 4,000 windows, evaluated on 20,000
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
"""

PLAIN = """
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
xt, yt = torch.as_tensor(x), torch.as_tensor(y)
for start in range(0, len(xt), 1000):
    logits = model(xt[start : start + 1000])
    target = yt[start : start + 1000].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target)
    opt.zero_grad(); loss.backward(); opt.step()
xv, yv = torch.as_tensor(x_val), torch.as_tensor(y_val)
with torch.no_grad():
    total = 0.0
    for start in range(0, len(xv), 1000):
        logits = model(xv[start : start + 1000])
        target = yv[start : start + 1000].reshape(-1)
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target))
"""

OURS = """
import somatize as sz
net = sz.TorchFilter(
    model, loss="cross_entropy", optimizer="adam", lr=1e-3, batch_size=1000, shuffle=False
)
fitted = sz.Graph([net]).fit(x, y, validation=(x_val, y_val))
assert len(fitted.history) == 1 and "val_loss" in fitted.history[0]
"""

GIGABYTE = """
import numpy as np, torch
import somatize as sz

class Generated(torch.utils.data.Dataset):
    # 262,144 rows of 1,024 float32: 1 GiB, each row made when it is read
    def __len__(self):
        return 1 << 18
    def __getitem__(self, i):
        return np.full(1024, (i % 97) / 97.0, dtype=np.float32), int(i % 2)
    def __getitems__(self, rows):  # a batch in one call, as a Hugging Face dataset reads
        block = np.repeat(((np.asarray(rows) % 97) / 97.0).astype(np.float32)[:, None], 1024, 1)
        return [(row, int(i % 2)) for row, i in zip(block, rows)]

torch.manual_seed(0)
net = sz.TorchFilter(torch.nn.Linear(1024, 2), loss="cross_entropy", batch_size=4096, shuffle=False)
fitted = sz.Graph([net]).fit(Generated())
assert len(fitted.history) == 1
"""

REPORT = """
import json
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"peak_mib": peak / 1024}))
"""
# (VmHWM, the process's own peak: ru_maxrss keeps the forking parent's across the exec, and a
# pytest worker that loaded a Hugging Face model is 1.6 GB)
# (batches of 1,000 windows: their logits are 31 MiB; the whole set's, 625 MiB)


def peak_mib(code: str) -> float:
    """The peak resident memory of a fresh process that runs ``code``, in MiB."""
    script = textwrap.dedent(code) + REPORT
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"])


def test_fit_and_validation_on_20000_windows_stay_under_twice_the_plain_loops_peak():
    """Training on 4,000 windows and evaluating on 20,000, as a plain loop does in batches."""
    plain = peak_mib(WINDOWS + PLAIN)
    ours = peak_mib(WINDOWS + OURS)
    # The whole set's logits alone are 20,000 x 128 x 64 floats: 625 MiB, twice over.
    assert ours < 2 * plain, (ours, plain)


def test_a_one_gigabyte_dataset_trains_without_being_held():
    peak = peak_mib(GIGABYTE)
    assert peak < 1024 * 0.9, peak  # torch and a batch of 16 MiB, not the 1 GiB of rows
