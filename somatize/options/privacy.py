"""User-level differential privacy and secure aggregation for FedAvg and FedProx
(``coordinator.strategies.federated.privacy``, ``...secure_aggregation``)::

    sz.FedAvg(rounds=100, fraction=0.1, privacy=sz.FixedClipping(clip_norm=1.0,
                                                                  noise_multiplier=1.1))

Each class is its options model (:mod:`protocol.options.privacy`,
:mod:`protocol.options.secure_aggregation`: the parameters, their checks and their
documentation), taking its arguments positionally too.
"""

from __future__ import annotations

from protocol.options import privacy as options
from protocol.options.secure_aggregation import SecAggOptions
from somatize.options.components import Component, SdkOptions

__all__ = ["AdaptiveClipping", "FixedClipping", "PrivacyMechanism", "SecAgg"]


class PrivacyMechanism(Component, options.PrivacyMechanismOptions):
    pass


class FixedClipping(PrivacyMechanism, options.FixedClippingOptions):
    __init__ = SdkOptions.__init__
    positional = ("clip_norm", "noise_multiplier", "side")


class AdaptiveClipping(PrivacyMechanism, options.AdaptiveClippingOptions):
    __init__ = SdkOptions.__init__
    positional = ("noise_multiplier", "initial_clip", "target_quantile", "clip_lr", "count_stddev")


class SecAgg(Component, SecAggOptions):
    __init__ = SdkOptions.__init__
