"""A torch.distributed store that only the members of one job's group can use.

A group's members meet at a store on its first member: they write their gloo (or NCCL)
addresses there and read each other's. torch's ``TCPStore`` listens on every interface and asks
nothing of whoever connects: another job's code on any machine that reaches it listed a job's
keys (``list_keys``), read its members' addresses and wrote keys into it (issue 53). So the
first member serves :class:`StoreServer` instead, on the address the others dial (where that is
one of this machine's), and every connection proves it holds the group's secret before any key
is read or written: HMAC-SHA256 of a fresh server nonce under the secret (RFC 2104), answered
by the server's proof over the client's nonce, so neither side can be stood in for. The
coordinator makes the secret for each rendezvous and gives it to the members over its
authenticated connections to their agents; it never travels otherwise, and a connection that
fails the proof is closed having read nothing.

:class:`AuthenticatedStore` is the members' side: a ``torch.distributed.Store`` (torch calls
its Python methods), so ``init_process_group(store=PrefixStore(prefix, AuthenticatedStore(...)))``
rendezvouses through it as through a ``TCPStore``. The operations are those gloo, NCCL and
``init_process_group`` use (set, get, add, wait, check, compare_set, delete_key, num_keys);
``get`` and ``wait`` block on the server until the key is set or the store's timeout passes.

What gloo itself opens is not covered: its pair connections (one per pair of members, on
ports the members publish through the store) carry tensors and take no proof of their own;
only processes that can reach a member's address can dial them, and they learn the ports only
through the store (docs/security-model.md).

Wire: a request is one byte of operation, a ``u32`` count of fields and each field as a
``u32`` length and its bytes; a reply is one status byte and the same fields. No pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["AuthenticatedStore", "StoreRefused", "StoreServer"]

NONCE_BYTES = 32
PROOF_BYTES = 32
MAX_FIELD_BYTES = 64 << 20
"""The largest key or value a store holds (gloo's addresses are bytes; a field beyond this
closes the connection)."""
MAX_FIELDS = 1 << 16
HANDSHAKE_SECONDS = 10.0
"""How long a new connection has to prove the secret."""

_OK, _TIMEOUT, _REFUSED = 0, 1, 2
_SET, _GET, _ADD, _CHECK, _WAIT, _COMPARE_SET, _DELETE, _NUM_KEYS = range(1, 9)
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


def _proof(secret: bytes, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, side + nonce, hashlib.sha256).digest()


class StoreRefused(ConnectionError):
    """The store could not be used: the peer failed the proof, or closed, or said why."""


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            raise StoreRefused("the store's connection closed")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _send(sock: socket.socket, head: int, fields: Sequence[bytes]) -> None:
    out = [bytes([head]), _U32.pack(len(fields))]
    for field in fields:
        out += [_U32.pack(len(field)), field]
    sock.sendall(b"".join(out))


def _receive(sock: socket.socket) -> tuple[int, list[bytes]]:
    head = _exactly(sock, 1)[0]
    (count,) = _U32.unpack(_exactly(sock, 4))
    if count > MAX_FIELDS:
        raise StoreRefused(f"{count} fields in one message")
    fields = []
    for _ in range(count):
        (n,) = _U32.unpack(_exactly(sock, 4))
        if n > MAX_FIELD_BYTES:
            raise StoreRefused(f"a field of {n} bytes")
        fields.append(_exactly(sock, n))
    return head, fields


class StoreServer:
    """The store one group meets at, served on ``address`` (``""``: every interface) from a
    thread per connection, each connection proving ``secret`` first (module docstring).

    Args:
        secret: the group's secret (hex).
        address: where to listen: the address the other members dial, where it is one of
            this machine's, else every interface.
        timeout: the most seconds a ``get`` or ``wait`` blocks for its keys (a member asks
            for its own store timeout, up to this).
    """

    def __init__(self, secret: str, address: str, timeout: float) -> None:
        self._secret = bytes.fromhex(secret)
        self._timeout = timeout
        self._keys: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._listener = _listener(address)
        self._closed = False
        self._connections: set[socket.socket] = set()
        self.port: int = self._listener.getsockname()[1]
        self.refused = 0
        """Connections closed for failing the proof."""
        threading.Thread(target=self._accept, name="rendezvous store", daemon=True).start()

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        with self._changed:
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        self._connections.add(connection)
        try:
            connection.settimeout(HANDSHAKE_SECONDS)
            if not self._proven(connection):
                self.refused += 1
                return
            connection.settimeout(None)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closed:
                op, fields = _receive(connection)
                status, answer = self._answer(op, fields)
                _send(connection, status, answer)
        except (OSError, StoreRefused, ValueError, IndexError, struct.error):
            return
        finally:
            self._connections.discard(connection)
            connection.close()

    def _proven(self, connection: socket.socket) -> bool:
        nonce = os.urandom(NONCE_BYTES)
        connection.sendall(nonce)
        said = _exactly(connection, PROOF_BYTES + NONCE_BYTES)
        if not hmac.compare_digest(said[:PROOF_BYTES], _proof(self._secret, b"member", nonce)):
            return False
        connection.sendall(_proof(self._secret, b"store", said[PROOF_BYTES:]))
        return True

    def _answer(self, op: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        keys, changed = self._keys, self._changed
        with changed:
            if op == _SET:
                keys[fields[0]] = fields[1]
                changed.notify_all()
                return _OK, []
            if op == _ADD:
                total = int(keys.get(fields[0], b"0")) + _I64.unpack(fields[1])[0]
                keys[fields[0]] = str(total).encode()
                changed.notify_all()
                return _OK, [_I64.pack(total)]
            if op == _COMPARE_SET:
                key, expected, desired = fields
                current = keys.get(key)
                if (current is None and expected == b"") or current == expected:
                    keys[key] = desired
                    changed.notify_all()
                    return _OK, [desired]
                return _OK, [expected if current is None else current]
            if op == _CHECK:
                return _OK, [bytes([all(k in keys for k in fields)])]
            if op == _DELETE:
                return _OK, [bytes([keys.pop(fields[0], None) is not None])]
            if op == _NUM_KEYS:
                return _OK, [_I64.pack(len(keys))]
            if op in (_GET, _WAIT):  # the seconds to wait, then the keys
                seconds = min(_I64.unpack(fields[0])[0] / 1e3, self._timeout)
                wanted = fields[1:]
                ready = changed.wait_for(
                    lambda: self._closed or all(k in keys for k in wanted), seconds
                )
                if not ready or self._closed:
                    return _TIMEOUT, [b"keys " + b", ".join(wanted)[:200] + b" not set in time"]
                return _OK, [keys[wanted[0]]] if op == _GET else []
        return _REFUSED, [f"unknown operation {op}".encode()]


def _listener(address: str) -> socket.socket:
    """A listening socket on ``address`` where it is one of this machine's, else on every
    interface (``address`` a name, or the address of another machine's NAT)."""
    for host in (address, ""):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    raise OSError(f"the rendezvous store cannot listen on {address!r} or every interface")


class AuthenticatedStore(dist.Store):  # type: ignore[name-defined,misc]
    """A member's connection to a :class:`StoreServer`, as a ``torch.distributed.Store``.

    Raises (from the constructor):
        StoreRefused: it cannot connect within ``timeout`` seconds, or the server does not
            prove the secret (or refuses this member's proof).
    """

    def __init__(self, host: str, port: int, secret: str, timeout: float) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout
        while True:  # the server may be a moment from listening: retry until the deadline
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    said = f"cannot reach the rendezvous at {host}:{port}: {exc}"
                    raise StoreRefused(said) from exc
                time.sleep(0.05)
        key = bytes.fromhex(secret)
        try:
            nonce = _exactly(self._sock, NONCE_BYTES)
            mine = os.urandom(NONCE_BYTES)
            self._sock.sendall(_proof(key, b"member", nonce) + mine)
            answer = _exactly(self._sock, PROOF_BYTES)
        except (OSError, StoreRefused) as exc:
            self._sock.close()
            raise StoreRefused(
                f"the rendezvous at {host}:{port} refused this member's proof: {exc}"
            ) from exc
        if not hmac.compare_digest(answer, _proof(key, b"store", mine)):
            self._sock.close()
            raise StoreRefused(f"the rendezvous at {host}:{port} did not prove the group's secret")
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call(self, op: int, fields: Sequence[bytes]) -> list[bytes]:
        with self._lock:
            _send(self._sock, op, fields)
            status, answer = _receive(self._sock)
        if status == _TIMEOUT:
            raise dist.DistStoreError(answer[0].decode(errors="replace"))
        if status != _OK:
            raise StoreRefused(answer[0].decode(errors="replace") if answer else "refused")
        return answer

    def set(self, key: str, value: bytes | str) -> None:
        self._call(_SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call(_GET, [self._wait_for(None), key.encode()])[0]

    def add(self, key: str, amount: int) -> int:
        return int(_I64.unpack(self._call(_ADD, [key.encode(), _I64.pack(amount)])[0])[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(_COMPARE_SET, [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys])[0] == b"\x01"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(_WAIT, [self._wait_for(timeout), *(k.encode() for k in keys)])

    def _wait_for(self, timeout: timedelta | None) -> bytes:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        return _I64.pack(int(seconds * 1e3))

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, [key.encode()])[0] == b"\x01"

    def num_keys(self) -> int:
        return int(_I64.unpack(self._call(_NUM_KEYS, [])[0])[0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
