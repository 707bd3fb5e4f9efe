"""A fleet on one coordinator (``python -m benchmarks.fleet``, and ``fleet`` in the suite): 1,000
simulated workers, what they cost it idle and one FedAvg round over all of them, next to a bare
``websockets`` server holding as many connections. :mod:`~benchmarks.fleet.bench` runs it
(``run()``, ``rows()``); :mod:`~benchmarks.fleet.sim` holds the simulated agents, N WebSocket
connections on one event loop answering job messages from memory (:mod:`benchmarks.scheduling`
replays its day on them too); :mod:`~benchmarks.fleet.measure` the heartbeat probe, the anchor
server and the samplers it measures with."""
