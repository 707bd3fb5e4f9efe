"""Benchmarks: ``python -m benchmarks.<name>`` prints figures next to a plain-copy anchor.

A benchmark of one module is a module here, named for its command (``codec``, ``allreduce``,
``sharded_memory``, ...); a benchmark of several is a folder with the same command, its
``bench.py`` the one that runs it (``faults/``, ``attacks/``, ``fleet/``, ``federated/``,
``slow_links/``); ``anchors/`` holds torch's own pipelining and FSDP2 for the modules that
compare with them. :mod:`benchmarks.report` is the suite's table (``python -m benchmarks``),
:mod:`benchmarks.periodic` the sampler they watch a process with, and
:mod:`benchmarks.scenario_cli` the command line of ``faults`` and ``attacks``.
"""
