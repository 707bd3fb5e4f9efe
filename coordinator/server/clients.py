"""Who a client is: the name its token stands for, and whether it administers the coordinator.

A coordinator takes one client token (``--client-token-file``: its holder is the ``client``
admin) or several named ones (``--client-tokens-file``, a line ``NAME TOKEN [admin]`` each).
A job belongs to the client that submitted it: a client sees, watches, fetches and cancels only
its own jobs — another's is "no job" to it, as one that does not exist — unless it is an admin.
Without client tokens (loopback, or ``--insecure``) everyone is the ``client`` admin. The
server learns who a ``/client`` connection is from the token of its upgrade and keeps it for the
connection's life (:class:`ConnectedClients`). No I/O.
"""

from __future__ import annotations

import hmac
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.jobs.manager import DEFAULT_OWNER

__all__ = ["EVERYONE", "ClientIdentity", "ClientTokens", "ConnectedClients"]


@dataclass(frozen=True)
class ClientIdentity:
    """A client's name (the owner of its jobs) and whether it may see and cancel every job."""

    name: str
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        """Whether a job of ``owner`` (``None``: from before owners were kept) is this
        client's to see."""
        return self.admin or owner == self.name


EVERYONE = ClientIdentity(DEFAULT_OWNER, admin=True)
"""Whoever connects without client tokens, or with the single ``--client-token-file`` one."""


class ClientTokens:
    """The client tokens a coordinator takes, and whose each is.

    Args:
        tokens: token → the identity it stands for.

    Raises:
        ValueError: no token, an empty one, or one name given two tokens.
    """

    def __init__(self, tokens: Mapping[str, ClientIdentity]) -> None:
        if not tokens or not all(tokens):
            raise ValueError("client tokens must be non-empty, and at least one")
        names = [identity.name for identity in tokens.values()]
        if len(set(names)) != len(names):
            raise ValueError("each client name has one token")
        self._tokens = {token.encode(): identity for token, identity in tokens.items()}

    @classmethod
    def single(cls, token: str) -> ClientTokens:
        """One token, for the ``client`` admin."""
        return cls({token: EVERYONE})

    @classmethod
    def parse(cls, text: str, where: str) -> ClientTokens:
        """The tokens of a ``--client-tokens-file``: per line ``NAME TOKEN`` or
        ``NAME TOKEN admin``; blank lines and ``#`` comments are skipped.

        Raises:
            ValueError: a line that is not one of those (naming ``where`` and its number).
        """
        tokens: dict[str, ClientIdentity] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "admin"):
                raise ValueError(
                    f"{where}, line {number}: expected 'NAME TOKEN' or 'NAME TOKEN admin'"
                )
            if fields[1] in tokens:
                raise ValueError(f"{where}, line {number}: a token given twice")
            tokens[fields[1]] = ClientIdentity(fields[0], admin=len(fields) == 3)
        try:
            return cls(tokens)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def merged(self, other: ClientTokens) -> ClientTokens:
        """These tokens and ``other``'s."""
        both = {token.decode(): who for token, who in (*self.items(), *other.items())}
        return ClientTokens(both)

    def items(self) -> Iterable[tuple[bytes, ClientIdentity]]:
        return self._tokens.items()

    def holds(self, token: str) -> bool:
        """Whether ``token`` is one of them (to refuse a worker token that is also a client's)."""
        return token.encode() in self._tokens

    def identify(self, offered: bytes) -> ClientIdentity | None:
        """Whose ``offered`` token it is; ``None``: nobody's. Every token is compared, in
        constant time each, so the time taken does not say which one came close."""
        found = None
        for token, identity in self._tokens.items():
            if hmac.compare_digest(token, offered):
                found = identity
        return found


class ConnectedClients:
    """Who each ``/client`` connection is, from the token of its upgrade, for as long as the
    connection lives (the connections are weakly held: one that closes is forgotten)."""

    def __init__(self) -> None:
        self._by_connection: weakref.WeakKeyDictionary[object, ClientIdentity] = (
            weakref.WeakKeyDictionary()
        )

    def __setitem__(self, connection: object, client: ClientIdentity) -> None:
        self._by_connection[connection] = client

    def of(self, connection: object) -> ClientIdentity:
        """Who the client on ``connection`` is; :data:`EVERYONE` for a connection no token
        named (there are no client tokens)."""
        try:
            return self._by_connection.get(connection) or EVERYONE
        except TypeError:  # not a connection that can be weakly held: not one of the server's
            return EVERYONE
