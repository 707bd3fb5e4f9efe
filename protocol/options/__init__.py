"""The one definition of every option a job may ask for.

One pydantic model per strategy (:mod:`~protocol.options.strategies`,
:mod:`~protocol.options.federated`), per server optimizer, per robust aggregator
(:mod:`~protocol.options.aggregators`), per privacy mode (:mod:`~protocol.options.privacy`,
:mod:`~protocol.options.secure_aggregation`); the SDK builds them from its arguments, the wire
carries them, the coordinator reads them. :mod:`~protocol.options.base` holds the machinery and
the wording of refusals.
"""
