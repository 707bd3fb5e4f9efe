"""Faults survived (``python -m benchmarks.faults``, written to ``docs/reliability.md``): each
fault the system is meant to survive injected on a real local cluster, its detection and
recovery timed. :mod:`~benchmarks.faults.bench` runs the scenarios and writes the page;
:mod:`~benchmarks.faults.harness` holds the clusters they share, their waits and the jobs they
submit; :mod:`~benchmarks.faults.scenarios` the scenarios of lost workers, links and daemons,
:mod:`~benchmarks.faults.resume` those a job comes through from its last checkpoint, and
:mod:`~benchmarks.faults.checkpoints` those around checkpoints beyond DataParallel's. The
attacks of :mod:`benchmarks.attacks` run on the same harness."""
