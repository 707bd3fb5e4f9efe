"""The one training runtime: fit, forward and train a chain of filters in one process.

``graph.fit`` in the user's process and the filter daemon on a worker both run this code
(:class:`engine.engine.Engine`, which holds one part of each module below); no second copy of a
training loop exists anywhere.

* :mod:`engine.engine` — the :class:`~engine.engine.Engine`: the parts below, wired together;
* :mod:`engine.nodes` — the loaded filters, their states, forward passes on the device;
* :mod:`engine.optimizers` — their persistent optimizers and schedulers, one step of a run;
* :mod:`engine.held_rows` — rows held under a name, read ahead;
* :mod:`engine.fitting` — fit, forward, and ``batched_fit`` (what ``graph.fit`` runs);
* :mod:`engine.training` — the one training loop, of a differentiable run;
* :mod:`engine.evaluation`, :mod:`engine.metrics` — validation loss and metrics;
* :mod:`engine.gradients` — reading and applying gradients;
* :mod:`engine.stepping` — learning-rate schedules, clipping, accumulation;
* :mod:`engine.data_parallel` — a data-parallel replica in a torch.distributed group and the
  loop it runs, its FSDP2 shards, DiLoCo's outer step, its gradients' compression;
* :mod:`engine.pipeline` — a pipeline stage, driven by calls or running its own schedule over
  torch.distributed (the loop a linked stage runs);
* :mod:`engine.group_member` — joining a torch.distributed group;
* :mod:`engine.transfer` — devices and precision;
* :mod:`engine.data` — datasets and the row readers behind them.

Importing this package imports nothing heavy: every module imports torch itself.
"""
