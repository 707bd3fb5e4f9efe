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
"""

from somatize.errors import GraphError, SomatizeError
from somatize.filters import Filter, TorchFilter
from somatize.graph import FittedGraph, Graph

__all__ = ["Filter", "FittedGraph", "Graph", "GraphError", "SomatizeError", "TorchFilter"]
__version__ = "0.1.0"
