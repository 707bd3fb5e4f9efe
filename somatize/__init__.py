"""somatize: train graphs of filters, in-process or across machines.

The SDK's surface::

    import somatize as sz

    class Center(sz.Filter):
        def fit(self, x, y=None): return {"mean": x.mean(0)}
        def forward(self, x, state): return x - state["mean"]

    net = sz.TorchFilter(torch.nn.Sequential(...), loss="cross_entropy", optimizer="sgd",
                         lr=0.1, batch_size=64, epochs=5, shuffle=True, seed=0)
    graph = Center().named("center") >> net.named("mlp")
    fitted = graph.fit(x, y)
    out = fitted.forward(x_test)
    fitted.states["mlp"]            # the module's state_dict (tensors)
    fitted.save("digits.pt")        # no pickle: torch.load(..., weights_only=True) reads it
    fitted = sz.load("digits.pt", graph)

    with sz.connect("ws://127.0.0.1:8765") as client:   # the same graph, on a worker
        job = client.submit(graph, x, y, strategy=sz.Local())
        fitted = job.result()
"""

import importlib
from typing import TYPE_CHECKING, Any

from somatize.errors import ClientError, ConnectionFailed, GraphError, JobFailed, SomatizeError
from somatize.options.aggregators import Aggregator, Bulyan, FedMedian, Krum, TrimmedMean
from somatize.options.privacy import AdaptiveClipping, FixedClipping, PrivacyMechanism, SecAgg
from somatize.options.strategies import (
    DataParallel,
    DiLoCo,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    Local,
    ModelParallel,
    Partition,
    QFedAvg,
    ServerOptimizer,
    Strategy,
    WorkerData,
)

if TYPE_CHECKING:
    from somatize.filters import TorchFilter
    from somatize.graph import Filter, FittedGraph, Graph, load
    from somatize.remote.client import Client, connect
    from somatize.remote.jobs import Job, JobCheckpoint, JobEventInfo

_LAZY = {
    "Client": "somatize.remote.client",
    "connect": "somatize.remote.client",
    "Filter": "somatize.graph",
    "TorchFilter": "somatize.filters",
    "FittedGraph": "somatize.graph",
    "Graph": "somatize.graph",
    "Job": "somatize.remote.jobs",
    "JobCheckpoint": "somatize.remote.jobs",
    "JobEventInfo": "somatize.remote.jobs",
    "load": "somatize.graph",
}
"""What imports torch, imported on first use: ``somatize status`` and the other commands that
only talk to a coordinator start without it (importing torch takes seconds)."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'somatize' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AdaptiveClipping",
    "Aggregator",
    "Bulyan",
    "Client",
    "ClientError",
    "ConnectionFailed",
    "DataParallel",
    "DiLoCo",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedMedian",
    "FedProx",
    "FedYogi",
    "Filter",
    "FittedGraph",
    "FixedClipping",
    "Graph",
    "GraphError",
    "Job",
    "JobCheckpoint",
    "JobEventInfo",
    "JobFailed",
    "Krum",
    "Local",
    "ModelParallel",
    "Partition",
    "PrivacyMechanism",
    "QFedAvg",
    "SecAgg",
    "ServerOptimizer",
    "SomatizeError",
    "Strategy",
    "TorchFilter",
    "TrimmedMean",
    "WorkerData",
    "connect",
    "load",
]
__version__ = "0.1.0"
