"""The virtual clients' rows both sides of benchmarks.federated train on (ours, and Flower's
simulation in its own environment): by hand, and as the coordinator cuts them."""

from __future__ import annotations

import pytest

from benchmarks.federated.partition import client_rows
from coordinator.strategies.federated.cohort import Cohort


def test_rows_by_hand():
    # Worker 0 has 10 rows in 3 parts: 4, 3, 3 (array_split: the first 10 mod 3 parts are one
    # longer); worker 1 has 7 rows: 3, 2, 2.
    expected = [
        (0, slice(0, 4)),
        (0, slice(4, 7)),
        (0, slice(7, 10)),
        (1, slice(0, 3)),
        (1, slice(3, 5)),
        (1, slice(5, 7)),
    ]
    assert [client_rows(c, 3, [10, 7]) for c in range(6)] == expected


def test_one_client_a_worker_trains_on_all_its_rows():
    assert [client_rows(c, 1, [5, 8]) for c in range(2)] == [(0, slice(0, 5)), (1, slice(0, 8))]


@pytest.mark.parametrize(("rows", "per_worker"), [((8000, 8000), 500), ((37, 12, 5), 5)])
def test_rows_are_the_coordinators(rows, per_worker):
    cohort = Cohort([f"w{i}" for i in range(len(rows))], per_worker=per_worker)
    cohort.rows = dict(enumerate(rows))
    for client in cohort.clients():
        worker, part = client_rows(client, per_worker, rows)
        assert worker == cohort.worker_of(client)
        assert list(range(rows[worker])[part]) == cohort.partition(client)


@pytest.mark.parametrize(("client", "per_worker"), [(6, 3), (-1, 3), (0, 0)])
def test_a_client_outside_the_workers_is_refused(client, per_worker):
    with pytest.raises(ValueError, match=r"client|per_worker"):
        client_rows(client, per_worker, [10, 7])
