"""Who may change the indexer service's state: the shared tokens of ``auth_token_file`` and the owner of each
booking.

With tokens configured, ``/route``, ``/requests/{id}/first_token`` and ``/requests/{id}/finish`` need
``Authorization: Bearer <token>`` naming one of them (compared in constant time, every token tried), and a
client is its token: bookings are counted and released per token. Without tokens a client is its peer address
(:func:`peer_key`): clients behind one proxy or NAT share it, so they can release each other's bookings.

A booking holds its prompt's block keys until it ends, so bookings are capped in blocks as well as in number: a
client's count and the service's are each bounded, and so is the memory they hold.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections import Counter
from typing import NoReturn

from kvtier.util.fields import ConfigError
from kvtier.util.infile import read_text

MAX_TOKEN_FILE_BYTES = 1 << 16


class Unauthorized(Exception):
    """A state-changing request without a valid token (401)."""


class Forbidden(Exception):
    """A request releasing another client's booking (403)."""


class TooManyInFlight(Exception):
    """A booking past a cap: ``status`` 429 (this client's cap) or 503 (the service's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def load_tokens(path: str) -> list[bytes]:
    """The tokens in ``path``, one a line (blank lines and ``#`` comments skipped); :class:`ConfigError` naming
    the file if it cannot be read or is not a regular file, is not UTF-8, is larger than 64 KiB or holds no token."""
    try:
        text = read_text(path, MAX_TOKEN_FILE_BYTES, "tokens, one a line")
    except ValueError as exc:
        raise ConfigError(f"auth_token_file {path}: {exc}") from None
    tokens = [ln.strip() for ln in text.splitlines()]
    tokens = [t for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise ConfigError(f"auth_token_file {path}: holds no token")
    if any(not t.isascii() or " " in t for t in tokens):
        raise ConfigError(f"auth_token_file {path}: a token must be ASCII without spaces")
    return [t.encode() for t in tokens]


def peer_key(address: str | None) -> str:
    """Who a peer address is, for the caps each client has: the address, an IPv4-mapped IPv6 one as its IPv4
    address (a dual-stack socket's view of an IPv4 peer); ``?`` for none."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class ServiceUnavailable(RuntimeError):
    """The service cannot answer truthfully (its event loop died): a 503, whoever asks."""


class Clients:
    """The tokens, and the owner and size (blocks) of every booking in flight, with each owner's count and blocks.
    What holds: :attr:`blocks` and each owner's count and blocks are the sums over :attr:`_owner`'s bookings, and
    an owner with no booking has no entry. Not thread-safe: the service calls :meth:`book` / :meth:`release` under
    its lock."""

    def __init__(self, tokens: list[bytes] | None, max_in_flight: int, max_per_client: int, max_blocks: int,
                 max_blocks_per_client: int) -> None:
        self._tokens = tokens
        self.max_in_flight = max_in_flight
        self.max_per_client = max_per_client
        self.max_blocks = max_blocks
        self.max_blocks_per_client = max_blocks_per_client
        self._owner: dict[str, tuple[str, int]] = {}  # request id -> its owner, its prompt's blocks
        self._count: Counter[str] = Counter()  # owner -> bookings in flight
        self._blocks: Counter[str] = Counter()  # owner -> blocks of its bookings in flight
        self.blocks = 0  # blocks of every booking in flight
        self.refused_auth = 0  # requests refused 401
        self.refused_owner = 0  # releases refused 403
        self.refused_full = 0  # bookings refused 429 or 503

    @property
    def tokens_required(self) -> bool:
        return self._tokens is not None

    def identify(self, authorization: str | None, peer: str | None) -> str:
        """The client making a state-changing request: ``token:<n>`` (the n-th token) when tokens are configured,
        else ``peer:<address>``; :class:`Unauthorized` without a valid token. O(tokens), the same time whatever
        token matched (or none)."""
        if self._tokens is None:
            return f"peer:{peer_key(peer)}"
        scheme, _, given = (authorization or "").partition(" ")
        offered = given.strip().encode("utf-8", "replace")
        match = -1
        for i, token in enumerate(self._tokens):
            if hmac.compare_digest(offered, token) and scheme.lower() == "bearer":
                match = i
        if match < 0:
            self.refused_auth += 1
            raise Unauthorized("missing or invalid Authorization: Bearer token")
        return f"token:{match}"

    def check_room(self, owner: str, blocks: int) -> None:
        """:class:`TooManyInFlight` if a new booking by ``owner`` of a prompt of ``blocks`` blocks would pass a cap:
        503 for the service's, 429 for the client's. O(1)."""
        if len(self._owner) >= self.max_in_flight:
            self._refuse(503, f"{len(self._owner)} requests in flight; at most {self.max_in_flight}")
        if self.blocks + blocks > self.max_blocks:
            self._refuse(503, f"{self.blocks} prompt blocks in flight and this request's {blocks} would pass "
                              f"max_in_flight_blocks {self.max_blocks}")
        if self._count[owner] >= self.max_per_client:
            self._refuse(429, f"this client has {self._count[owner]} requests in flight; "
                              f"at most {self.max_per_client} per client")
        if self._blocks[owner] + blocks > self.max_blocks_per_client:
            self._refuse(429, f"this client has {self._blocks[owner]} prompt blocks in flight and this request's "
                              f"{blocks} would pass max_in_flight_blocks_per_client {self.max_blocks_per_client}")

    def _refuse(self, status: int, message: str) -> NoReturn:
        self.refused_full += 1
        raise TooManyInFlight(status, message)

    def book(self, rid: str, owner: str, blocks: int) -> None:
        """``rid`` is in flight for ``owner``, holding ``blocks`` blocks (:meth:`check_room` passed). O(1)."""
        self._owner[rid] = (owner, blocks)
        self._count[owner] += 1
        self._blocks[owner] += blocks
        self.blocks += blocks

    def check_owner(self, rid: str, owner: str) -> None:
        """:class:`Forbidden` if ``rid`` is in flight for another client. O(1)."""
        held = self._owner.get(rid)
        if held is not None and held[0] != owner:
            self.refused_owner += 1
            raise Forbidden(f"request {rid!r} was booked by another client")

    def release(self, rid: str) -> None:
        """``rid`` is no longer in flight (finished or expired). O(1)."""
        held = self._owner.pop(rid, None)
        if held is None:
            return
        owner, blocks = held
        self.blocks -= blocks
        self._count[owner] -= 1
        self._blocks[owner] -= blocks
        if not self._count[owner]:
            del self._count[owner], self._blocks[owner]

    def __len__(self) -> int:
        return len(self._owner)
