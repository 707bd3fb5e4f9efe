"""Your own model on live workers: a dict batch and a ``step=`` function (its metric in the
history) through DataParallel on the torch collective, ``max_steps`` and ``validate_every``
there and in DiLoCo, and a torch pipeline whose first stage takes the dict — each equal to the
plain torch loop written in the tests (FedAvg on a dict batch: in process, in
:mod:`tests.coordinator.strategies.test_own_model`)."""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import dataset, graph_for
from tests.coordinator.strategies.test_own_model import Pooled, Whole, head
from tests.integration.cluster import cluster
from tests.somatize.own_models import (
    MaskedPool,
    TokenTagger,
    masked_token_step,
    plain_loop,
    token_rows,
)
from tests.somatize.test_own_model import (
    SETTINGS,
    assert_stopped_like_the_loop,
    close,
    cross_entropy,
    stopped_loop,
    stopped_run,
)
from tests.utils import UNIT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """Two workers (tagged ``stage0`` and ``stage1``) and a client of their coordinator."""
    workers = {"w0": ("stage0",), "w1": ("stage1",)}
    with cluster(tmp_path_factory.mktemp("own"), workers) as c, sz.connect(c.url) as connected:
        yield connected


def test_live_strategies_train_dict_batches_and_step_functions(client):
    x, y = token_rows()
    pooled = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", **SETTINGS)])
    strategy = sz.DataParallel(2, collective="torch")
    job = client.submit(pooled, x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    placed = next(e for e in job.events(timeout=30 * UNIT) if e.event == "placed")
    assert placed.data["collective"] == "torch"
    model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
    close(fitted.states["masked_pool"], model)

    stepped = sz.Graph([sz.TorchFilter(TokenTagger(), step=masked_token_step, **SETTINGS)])
    strategy = sz.DataParallel(2, collective="torch")
    fitted = client.submit(stepped, x, strategy=strategy).result(timeout=120 * UNIT)
    model, history = plain_loop(TokenTagger(), x, None, lambda m, b, _: masked_token_step(m, b))
    close(fitted.states["token_tagger"], model)
    assert [row["token_accuracy"] for row in fitted.history] == pytest.approx(
        [row["token_accuracy"] for row in history], abs=1e-6
    )

    first = sz.TorchFilter(Pooled(), **SETTINGS).named("pooled")
    last = sz.TorchFilter(head(), loss="cross_entropy", **SETTINGS).named("head")
    partitions = [sz.Partition(["pooled"], tag="stage0"), sz.Partition(["head"], tag="stage1")]
    strategy = sz.ModelParallel(partitions, 2, transport="torch")
    fitted = client.submit(first >> last, x, y, strategy=strategy).result(timeout=120 * UNIT)
    expected = plain_loop(Whole(Pooled(), head()), x, y, cross_entropy)[0].state_dict()
    for node in ("pooled", "head"):
        for key, value in fitted.states[node].items():
            want = expected[f"{node}.{key}"]
            torch.testing.assert_close(torch.as_tensor(value), want, atol=1e-5, rtol=0)


def test_live_max_steps_and_validate_every_on_the_torch_collective(client):
    net, x, y, x_val, y_val = stopped_run()
    strategy = sz.DataParallel(2, collective="torch")
    job = client.submit(sz.Graph([net]), x, y, strategy=strategy, validation=(x_val, y_val))
    fitted = job.result(timeout=120 * UNIT)
    model, losses, scores = stopped_loop(x, y, x_val, y_val)
    assert_stopped_like_the_loop(fitted.history, fitted.validations, losses, scores)
    close(fitted.states["mlp"], model)
    # DiLoCo stops there too, synchronising at the last step: on the torch collective as
    # through the coordinator (which tests/coordinator/strategies/data_parallel/test_diloco.py
    # holds to a hand loop).
    fits = {}
    for collective in ("torch", "coordinator"):
        diloco = sz.DiLoCo(2, sync_every=4, collective=collective)
        graph = sz.Graph([stopped_run(validate_every=None)[0]])
        fits[collective] = client.submit(graph, x, y, strategy=diloco).result(timeout=120 * UNIT)
        assert [row["epoch"] for row in fits[collective].history] == [1, 2]
    for key, value in fits["coordinator"].states["mlp"].items():
        want = torch.as_tensor(value)
        torch.testing.assert_close(torch.as_tensor(fits["torch"].states["mlp"][key]), want)


HELPERS = """
def halve(x):
    return x * 0.5
"""

HELPED = """
import torch

import {helpers}
from {helpers} import halve


class Helped(torch.nn.Sequential):
    \"\"\"The tests' MLP, its input and output halved by the user's own helper module, called
    both as a module's attribute and as a name imported from it.\"\"\"

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return {helpers}.halve(super().forward(halve(x)))


class Raising(Helped):
    def forward(self, x):
        raise ValueError("the user's own error")


class Lazy(Helped):
    \"\"\"One that imports a module of the user's only when it runs: nothing carries it.\"\"\"

    def forward(self, x):
        import {lazy}

        return super().forward(x) + {lazy}.SHIFT
"""


@pytest.fixture
def own_files(tmp_path):
    """The user's own model file and the helper modules it imports, in a folder on this
    process's path only (the workers' daemons have none of it): the model's module."""
    tag = uuid.uuid4().hex[:8]
    names = {"helpers": f"helpers_{tag}", "lazy": f"lazy_{tag}"}
    (tmp_path / f"{names['helpers']}.py").write_text(HELPERS)
    (tmp_path / f"{names['lazy']}.py").write_text("SHIFT = 0.0\n")
    (tmp_path / f"model_{tag}.py").write_text(HELPED.format(**names))
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(f"model_{tag}"), names
    finally:
        sys.path.remove(str(tmp_path))
        for name in [*names.values(), f"model_{tag}"]:
            sys.modules.pop(name, None)


def test_the_users_own_helper_modules_travel_with_the_job(client, own_files):
    """A forward that calls the user's helper module (imported at the top of the model's
    file) trains on live workers that do not have the file, equal to graph.fit; one that
    imports a module of the user's only inside forward fails naming it and the remedy."""
    model, names = own_files
    x, y = dataset()
    graph = graph_for("adam", module=model.Helped())
    fitted = client.submit(graph, x, y, strategy=sz.DataParallel(2)).result(timeout=120 * UNIT)
    expected = graph_for("adam", module=model.Helped()).fit(x, y)
    for key, value in expected.states["mlp"].items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    lazy = graph_for("adam", module=model.Lazy())
    lazy.fit(x, y)  # here, where the module is on the path, it runs
    with pytest.raises(sz.JobFailed) as failed:
        client.submit(lazy, x, y, strategy=sz.DataParallel(2)).result(timeout=120 * UNIT)
    message = str(failed.value)
    assert f"No module named '{names['lazy']}'" in message
    assert f"module '{names['lazy']}' is not installed where this worker runs" in message
    assert "import it there" not in message and f"so import '{names['lazy']}' there" in message


def test_a_failing_filters_traceback_names_the_users_own_file_and_line(client, own_files):
    """The traceback a worker sends back has the user's file and line (cloudpickle writes
    ``<dynamic-code>`` there), so the client can show the line from the file."""
    model, _ = own_files
    x, y = dataset()
    with pytest.raises(sz.JobFailed) as failed:
        client.submit(graph_for("adam", module=model.Raising()), x, y).result(timeout=60 * UNIT)
    source = model.__file__
    line = (
        Path(source)
        .read_text()
        .splitlines()
        .index('        raise ValueError("the user\'s own error")')
    )
    assert f'File "{source}", line {line + 1}, in forward' in failed.value.traceback
    assert "<dynamic-code>" not in failed.value.traceback
