"""Who may change the indexer service's state: the shared tokens of ``auth_token_file`` and the owner of each
booking.

With tokens configured, ``/route``, ``/requests/{id}/first_token`` and ``/requests/{id}/finish`` need
``Authorization: Bearer <token>`` naming one of them (compared in constant time, every token tried), and a
client is its token: bookings are counted and released per token. Without tokens a client is its peer address:
clients behind one proxy or NAT share it, so they can release each other's bookings.
"""

from __future__ import annotations

import hmac
from collections import Counter

from kvtier.util.fields import ConfigError

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
    the file if it cannot be read, is not UTF-8, is larger than 64 KiB or holds no token."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"auth_token_file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"auth_token_file {path}: larger than {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"auth_token_file {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    tokens = [ln.strip() for ln in text.splitlines()]
    tokens = [t for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise ConfigError(f"auth_token_file {path}: holds no token")
    if any(not t.isascii() or " " in t for t in tokens):
        raise ConfigError(f"auth_token_file {path}: a token must be ASCII without spaces")
    return [t.encode() for t in tokens]


class ServiceUnavailable(RuntimeError):
    """The service cannot answer truthfully (its event loop died): a 503, whoever asks."""


class Clients:
    """The tokens, and the owner of every booking in flight with each owner's count. Not thread-safe: the
    service calls :meth:`book` / :meth:`release` under its lock."""

    def __init__(self, tokens: list[bytes] | None, max_in_flight: int, max_per_client: int) -> None:
        self._tokens = tokens
        self.max_in_flight = max_in_flight
        self.max_per_client = max_per_client
        self._owner: dict[str, str] = {}  # request id -> its owner
        self._count: Counter[str] = Counter()  # owner -> bookings in flight
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
            return f"peer:{peer or '?'}"
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

    def check_room(self, owner: str) -> None:
        """:class:`TooManyInFlight` if a new booking by ``owner`` would pass a cap. O(1)."""
        if len(self._owner) >= self.max_in_flight:
            self.refused_full += 1
            raise TooManyInFlight(503, f"{len(self._owner)} requests in flight; at most {self.max_in_flight}")
        if self._count[owner] >= self.max_per_client:
            self.refused_full += 1
            raise TooManyInFlight(429, f"this client has {self._count[owner]} requests in flight; "
                                       f"at most {self.max_per_client} per client")

    def book(self, rid: str, owner: str) -> None:
        self._owner[rid] = owner
        self._count[owner] += 1

    def check_owner(self, rid: str, owner: str) -> None:
        """:class:`Forbidden` if ``rid`` is in flight for another client. O(1)."""
        held = self._owner.get(rid)
        if held is not None and held != owner:
            self.refused_owner += 1
            raise Forbidden(f"request {rid!r} was booked by another client")

    def release(self, rid: str) -> None:
        """``rid`` is no longer in flight (finished or expired). O(1)."""
        owner = self._owner.pop(rid, None)
        if owner is not None:
            self._count[owner] -= 1
            if not self._count[owner]:
                del self._count[owner]

    def __len__(self) -> int:
        return len(self._owner)
