"""Rules the engine and the coordinator's strategies must compute the same way.

Both sides of a job decide things that must agree to the bit: which rows make each global batch
(:mod:`~protocol.rules.batching`), what counts as a row and a label (:mod:`~protocol.rules.rows`),
how a gradient norm clips (:mod:`~protocol.rules.clipping`), how figures average over rows
(:mod:`~protocol.rules.row_means`) and why a run will not equal ``graph.fit``
(:mod:`~protocol.rules.equivalence`). Each rule is written once, here, with no I/O.
"""
