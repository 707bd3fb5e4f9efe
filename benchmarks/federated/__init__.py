"""FedAvg at many clients (``python -m benchmarks.federated``, and ``federated`` in the suite):
a round of 1,000 virtual clients against Flower's simulation engine and a plain loop, and what
secure aggregation and differential privacy cost a round. :mod:`~benchmarks.federated.bench`
runs it (``run()``, ``rows()``); :mod:`~benchmarks.federated.partition` says which rows each
virtual client trains on, for both sides; :mod:`~benchmarks.federated.flower_anchor` runs
Flower's side, :mod:`~benchmarks.federated.flower_sim`, with the Python of Flower's own
virtualenv, which ``flower_env.sh`` (``make flower-env``) makes with every version pinned by
``flower-constraints.txt``. Nothing here but ``bench.py`` imports the project: ``flower_sim``
and ``partition`` run in Flower's environment."""
