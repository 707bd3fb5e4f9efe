"""Workers far apart (``python -m benchmarks.slow_links``, written to its sections of
``docs/benchmarks.md``): DiLoCo and compressed gradients on links held to a rate and a delay,
next to DDP, PowerSGD and DiLoCo as plain torch writes them, in the same run on the same links.
:mod:`~benchmarks.slow_links.bench` runs it; :mod:`~benchmarks.slow_links.churn` its
``--churn`` part (checkpoints, a worker lost and a newcomer, Streaming DiLoCo);
:mod:`~benchmarks.slow_links.links` builds the sites, network namespaces behind shaped links;
:mod:`~benchmarks.slow_links.char_lm` is the workload, a character-level transformer on the
standard library's sources; :mod:`~benchmarks.slow_links.anchors` one rank of a torch anchor,
run as a process of its own."""
