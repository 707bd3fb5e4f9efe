"""Which rows of which worker's dataset a virtual client trains on, for both sides of
``benchmarks.federated``: our plain-loop anchor and Flower's simulation
(``benchmarks.federated.flower_sim``, run in Flower's own environment, so this module imports
nothing of ours).

It restates :meth:`coordinator.strategies.federated.cohort.Cohort.partition` (the coordinator is not
importable from Flower's environment): with ``sz.FedAvg(clients_per_worker=K)`` worker ``i``
trains clients ``i·K, ..., i·K + K − 1``, client ``i·K + j`` on the ``j``-th of ``K`` contiguous
parts of the worker's rows as ``numpy.array_split`` cuts them (the first ``rows mod K`` parts
one row longer). ``tests/benchmarks/federated/test_partition.py`` holds the two to each other.
"""

from __future__ import annotations

from collections.abc import Sequence


def client_rows(client: int, per_worker: int, worker_rows: Sequence[int]) -> tuple[int, slice]:
    """Client ``client``'s worker (its index in ``worker_rows``) and its rows there.

    Args:
        client: the client's number, ``0 <= client < len(worker_rows) * per_worker``.
        per_worker: K, the clients of each worker.
        worker_rows: each worker's rows, in the order of the workers.
    """
    if per_worker < 1:
        raise ValueError(f"per_worker must be at least 1, not {per_worker}")
    if not 0 <= client < len(worker_rows) * per_worker:
        raise ValueError(
            f"client {client} is not one of the {len(worker_rows) * per_worker} clients of "
            f"{len(worker_rows)} workers × {per_worker}"
        )
    worker, j = divmod(client, per_worker)
    size, longer = divmod(worker_rows[worker], per_worker)  # array_split: `longer` parts of size+1
    start = j * size + min(j, longer)
    return worker, slice(start, start + size + (j < longer))
