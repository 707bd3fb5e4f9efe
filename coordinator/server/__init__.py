"""The coordinator's server: one port for workers, clients, health, metrics and the status page.

:mod:`~coordinator.server.config` holds its settings (:class:`CoordinatorConfig`, built by
:mod:`coordinator.cli`); :mod:`~coordinator.server.app` runs on them: it accepts connections and
routes each by its hello, a worker's to :mod:`~coordinator.server.worker_sessions` (its identity
checked, its record attached, its heartbeats and relayed tensors served) and a client's requests
to :mod:`~coordinator.server.client_requests`, which answers them on behalf of who
:mod:`~coordinator.server.clients` says they are. :mod:`~coordinator.server.http` answers plain
HTTP and checks each upgrade; :mod:`~coordinator.server.status` is what ``somatize status`` and
the status page (``static/``) show; :mod:`~coordinator.server.metrics` counts for ``/metrics``;
:mod:`~coordinator.server.pending` and :mod:`~coordinator.server.collector` keep the server
standing under many connections. The workers themselves are kept in :mod:`coordinator.workers`,
the jobs in :mod:`coordinator.jobs`.
"""
