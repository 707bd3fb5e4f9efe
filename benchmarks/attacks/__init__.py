"""Attacks refused (``python -m benchmarks.attacks``, written to ``docs/security.md``): each
attack of issue 14 and its followers made against a real local cluster, what the system did,
how fast it refused and what it cost the attacked process. :mod:`~benchmarks.attacks.bench`
runs the scenarios and writes the page; :mod:`~benchmarks.attacks.harness` holds the cluster
they land on and what they measure; :mod:`~benchmarks.attacks.scenarios` the attacks of issue
14, :mod:`~benchmarks.attacks.quota` its queued-inputs row, :mod:`~benchmarks.attacks.isolation`
issue 32's (clients sharing workers, job code reaching for the worker) and
:mod:`~benchmarks.attacks.trust` issue 53's (the trust boundaries where workers run). The waits
and the skip come from :mod:`benchmarks.faults`' harness."""
