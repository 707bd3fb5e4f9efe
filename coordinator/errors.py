"""Exceptions of the coordinator.

Exception tree::

    CoordinatorError             root of everything raised by :mod:`coordinator`
    └── StoreError               the job store refused a request or cannot be used
        │                        (:mod:`coordinator.store`)
        ├── UnknownJob           no job has that id (also a :class:`KeyError`)
        ├── DuplicateJob         a job with that id already exists
        ├── InvalidTransition    the job's state does not allow the request (a terminal job
        │                        never changes again)
        ├── NoResult             the job has no result: it did not succeed (yet)
        ├── ResultTooLarge       a result larger than SQLite can store in one value
        └── StoreInUse           another coordinator holds the state directory

Remote failures (a worker's error reply, a filter that raised) are data recorded on the job
(``error{code, message, detail}``), not exceptions of this tree.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Root of the errors raised by coordinator."""
