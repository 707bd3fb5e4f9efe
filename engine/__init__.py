"""The one training runtime: fit, forward and train a chain of filters in one process.

``graph.fit`` in the user's process and the filter daemon on a worker both run this code
(:class:`engine.engine.Engine`); no second copy of a training loop exists anywhere.

* :mod:`engine.nodes` — the loaded filters and what every part needs of them;
* :mod:`engine.training` — rows held under a name, fit, forward, the nodes' states;
* :mod:`engine.evaluation`, :mod:`engine.metrics` — validation loss and metrics;
* :mod:`engine.gradients` — persistent optimizers, reading and applying gradients;
* :mod:`engine.stepping` — learning-rate schedules, clipping, accumulation;
* :mod:`engine.replica` — a data-parallel replica in a torch.distributed group;
* :mod:`engine.stage`, :mod:`engine.linked_stage` — a pipeline stage, driven by calls or
  running its own schedule over torch.distributed;
* :mod:`engine.group_member` — joining a torch.distributed group;
* :mod:`engine.transfer` — devices and precision;
* :mod:`engine.data` — datasets and the row readers behind them.

Importing this package imports nothing heavy: every module imports torch itself.
"""
