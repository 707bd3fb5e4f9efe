"""The one definition of every option a job may ask for.

One pydantic model per strategy (:mod:`~protocol.options.strategies`,
:mod:`~protocol.options.federated`), per pipeline partition and worker dataset
(:mod:`~protocol.options.strategies`), per server optimizer
(:mod:`~protocol.options.server_optimizers`), per robust aggregator
(:mod:`~protocol.options.aggregators`), per privacy mode (:mod:`~protocol.options.privacy`) and
for secure aggregation (:mod:`~protocol.options.secure_aggregation`): the SDK's classes are these
models (``somatize`` subclasses them for positional arguments and ``spec()``), the wire carries
their :meth:`~protocol.options.base.Options.to_wire` form, the coordinator's strategies take them
whole. :mod:`~protocol.options.base` holds the machinery, the rules options share and the one
formatter of refusals; :mod:`~protocol.options.devices` the devices a job may ask for.

What the wire itself carries sits below it, parsed once where it enters:
:mod:`~protocol.options.compression` (what gradients travel as, a daemon command's
``compression``) and :mod:`~protocol.options.training` (how a chain of TorchFilters trains, a
graph node's ``training``), worded by :mod:`~protocol.options.refusals`.
"""
