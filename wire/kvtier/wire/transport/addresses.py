"""ZMQ addresses: the ones a router connects to, the ones an engine binds.

ZMQ checks little of an address before it is used, and some of what it takes is silently wrong: a TCP port past
65535 is taken modulo 65536 (``tcp://host:99999`` connects to, or binds, port 34463), and a wrong scheme, a
malformed host or a socket path too long for Unix sockets fail only once a socket is made, after a service has
started. These checks run where addresses are configured, so that a bad one is one clear line at start.
"""

from __future__ import annotations

import re

_SCHEMES = ("tcp", "ipc", "inproc")  # the transports kvtier's sockets use (no multicast: a replay needs a peer)
# A host name, an IPv4 address or a bracketed IPv6 one (ZMQ's "source;host" form is left out: a router connects
# to engines by address). A bind also takes "*" (every interface) and an interface name (a host name's syntax).
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")
_IPC_PATH_BYTES = 107  # a Unix socket path's limit on Linux (sun_path is 108 bytes, its NUL included)


def connect_address_error(address: str) -> str | None:
    """What keeps ``address`` from being a ZMQ address to connect to, or None: ``tcp://HOST:PORT`` (a port in
    1..65535), ``ipc://PATH`` or ``inproc://NAME``. O(len(address))."""
    return _error(address, bind=False)


def bind_address_error(address: str) -> str | None:
    """What keeps ``address`` from being a ZMQ address to bind, or None: as :func:`connect_address_error`, the
    host also ``*`` and the port also 0 or ``*`` (any free one). O(len(address))."""
    return _error(address, bind=True)


def _error(address: str, bind: bool) -> str | None:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in _SCHEMES:
        return f"expected {', '.join(s + '://...' for s in _SCHEMES)}"
    if not rest:
        return f"nothing after {scheme}://"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        lowest = 0 if bind else 1
        if not colon or not (_HOST.fullmatch(host) or (bind and host == "*")) or not (
                (port.isascii() and port.isdigit() and lowest <= int(port) <= 65535) or (bind and port == "*")):
            return (f"expected tcp://HOST:PORT with a port in {lowest}..65535"
                    + (" or * (any free one)" if bind else " (a host name or address to connect to)"))
    if scheme == "ipc" and len(rest.encode()) > _IPC_PATH_BYTES:
        return f"a socket path longer than {_IPC_PATH_BYTES} bytes"
    return None


__all__ = ["bind_address_error", "connect_address_error"]
