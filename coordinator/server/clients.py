"""Who a client is: the name its token stands for, and whether it administers the coordinator.

A coordinator takes one client token (``--client-token-file``: its holder is the ``client``
admin) or several named ones (``--client-tokens-file``, a line ``NAME TOKEN [admin]
[share=W] [max_workers=N] [max_priority=P]`` each: what the client is owed of the workers,
:class:`~coordinator.scheduling.shares.ClientPolicy`; an admin's priority has no ceiling unless
one is given).
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

from coordinator.jobs.manager import ADMIN_POLICY, DEFAULT_OWNER
from coordinator.scheduling.shares import DEFAULT_POLICY, ClientPolicy

__all__ = ["EVERYONE", "POLICY_FIELDS", "ClientIdentity", "ClientTokens", "ConnectedClients"]


@dataclass(frozen=True)
class ClientIdentity:
    """A client's name (the owner of its jobs) and whether it may see and cancel every job."""

    name: str
    admin: bool = False
    policy: ClientPolicy = DEFAULT_POLICY

    def may_see(self, owner: str | None) -> bool:
        """Whether a job of ``owner`` (``None``: from before owners were kept) is this
        client's to see."""
        return self.admin or owner == self.name


EVERYONE = ClientIdentity(DEFAULT_OWNER, admin=True, policy=ADMIN_POLICY)
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
        """The tokens of a ``--client-tokens-file``: per line ``NAME TOKEN``, then ``admin``
        and ``share=W``, ``max_workers=N``, ``max_priority=P`` if they apply; blank lines and
        ``#`` comments are skipped.

        Raises:
            ValueError: a line that is not one of those (naming ``where`` and its number).
        """
        tokens: dict[str, ClientIdentity] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            here = f"{where}, line {number}"
            if len(fields) < 2:
                raise ValueError(
                    f"{here}: expected 'NAME TOKEN [admin] [share=W] [max_workers=N] "
                    "[max_priority=P]'"
                )
            if fields[1] in tokens:
                raise ValueError(f"{here}: a token given twice")
            admin = "admin" in fields[2:]
            settings = [f for f in fields[2:] if f != "admin"]
            policy = _policy(settings, admin, here)
            tokens[fields[1]] = ClientIdentity(fields[0], admin=admin, policy=policy)
        try:
            return cls(tokens)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def policies(self) -> dict[str, ClientPolicy]:
        """Each client's policy, by name."""
        return {identity.name: identity.policy for identity in self._tokens.values()}

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


POLICY_FIELDS = {"share": float, "max_workers": int, "max_priority": int}
"""What a clients file line may set of its client's :class:`ClientPolicy`, and as what."""


def _policy(settings: list[str], admin: bool, here: str) -> ClientPolicy:
    """The policy ``settings`` (``KEY=VALUE`` each) give; an admin's priority has no ceiling
    unless one is set.

    Raises:
        ValueError: a setting that is not one of :data:`POLICY_FIELDS`, or a bad value.
    """
    values: dict[str, float | int | None] = {"max_priority": None} if admin else {}
    for setting in settings:
        key, _, value = setting.partition("=")
        kind = POLICY_FIELDS.get(key)
        if kind is None or not value:
            known = ", ".join(f"{k}=" for k in POLICY_FIELDS)
            raise ValueError(f"{here}: {setting!r} is not 'admin' or one of {known}")
        try:
            values[key] = kind(value)
        except ValueError:
            raise ValueError(f"{here}: {key} must be a {kind.__name__}, not {value!r}") from None
    try:
        return ClientPolicy(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{here}: {exc}") from None


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
