"""Byzantine-robust aggregation for FedAvg and FedProx: what replaces a round's weighted mean
when a few clients may send anything (``coordinator.strategies.federated.robust``)::

    sz.FedAvg(rounds=20, min_workers=7, aggregator=sz.Krum(byzantine=1, keep=3))

Each class is its options model (:mod:`protocol.options.aggregators`: the parameters, their
checks and their documentation), taking its arguments positionally too. A rule that a round of
``min_workers`` clients cannot hold is refused when the strategy is built.
"""

from __future__ import annotations

from protocol.options import aggregators as options
from somatize.options.components import Component, SdkOptions

__all__ = ["Aggregator", "Bulyan", "FedMedian", "Krum", "TrimmedMean"]


class Aggregator(Component, options.RobustRuleOptions):
    pass


class FedMedian(Aggregator, options.FedMedianOptions):
    __init__ = SdkOptions.__init__


class TrimmedMean(Aggregator, options.TrimmedMeanOptions):
    __init__ = SdkOptions.__init__


class Krum(Aggregator, options.KrumOptions):
    __init__ = SdkOptions.__init__


class Bulyan(Aggregator, options.BulyanOptions):
    __init__ = SdkOptions.__init__
