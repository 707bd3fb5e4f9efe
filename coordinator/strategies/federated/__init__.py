"""Federated learning: rounds of local training where the data is, averaged by the coordinator.

:mod:`~coordinator.strategies.federated.fedavg` (McMahan et al. 2017) fills the hooks of the round
loop (:mod:`coordinator.strategies.rounds`);
:mod:`~coordinator.strategies.federated.fedprox` and
:mod:`~coordinator.strategies.federated.qfedavg` change what clients train and how rounds fold;
:mod:`~coordinator.strategies.federated.cohort` keeps who takes part;
:mod:`~coordinator.strategies.federated.round_fold`,
:mod:`~coordinator.strategies.federated.server_optimizers` and
:mod:`~coordinator.strategies.federated.robust` turn a round's models into the next global one;
:mod:`~coordinator.strategies.federated.collection` brings a round's client models to its
aggregate, in the clear or, with :mod:`~coordinator.strategies.federated.secure_aggregation`,
masked; :mod:`~coordinator.strategies.federated.privacy` clips and noises them;
:mod:`~coordinator.strategies.federated.evaluation` evaluates each round's model.
"""
