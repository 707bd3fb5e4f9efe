"""The SDK's option classes: how a job is spread over workers
(:mod:`~somatize.options.strategies`), FedAvg's robust aggregators, server optimizers and privacy
(:mod:`~somatize.options.aggregators`, :mod:`~somatize.options.server_optimizers`,
:mod:`~somatize.options.privacy`), each a model of :mod:`protocol.options`, built as
:mod:`~somatize.options.components` says.
"""
