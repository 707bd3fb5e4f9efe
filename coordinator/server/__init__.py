"""The coordinator's server: one port for workers, clients, health, metrics and the status page.

:mod:`~coordinator.server.app` accepts connections and routes them (the workers are kept in
:mod:`coordinator.workers`);
:mod:`~coordinator.server.client_requests` answers clients, :mod:`~coordinator.server.clients`
says who they are; :mod:`~coordinator.server.http`, :mod:`~coordinator.server.metrics`,
:mod:`~coordinator.server.status_api` and :mod:`~coordinator.server.status_page` answer plain
HTTP; :mod:`~coordinator.server.pending` and :mod:`~coordinator.server.collector` keep the
server standing under many connections.
"""
