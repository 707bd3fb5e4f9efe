"""Federated learning: rounds of local training where the data is, averaged by the coordinator.

:mod:`~coordinator.strategies.federated.fedavg` (McMahan et al. 2017) is the round loop;
:mod:`~coordinator.strategies.federated.fedprox` and
:mod:`~coordinator.strategies.federated.qfedavg` change what clients train and how rounds fold;
:mod:`~coordinator.strategies.federated.cohort` keeps who takes part;
:mod:`~coordinator.strategies.federated.round_fold`,
:mod:`~coordinator.strategies.federated.server_optimizers` and
:mod:`~coordinator.strategies.federated.robust` turn a round's models into the next global one;
:mod:`~coordinator.strategies.federated.privacy` and
:mod:`~coordinator.strategies.federated.secure_aggregation` keep clients' updates private;
:mod:`~coordinator.strategies.federated.evaluation` evaluates each round's model.
"""
