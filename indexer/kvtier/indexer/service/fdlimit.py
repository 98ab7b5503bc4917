"""The open-files limit the indexer service needs, checked when it starts rather than found short mid-run.

Each engine endpoint costs a few descriptors (its SUB socket's TCP connection and mailbox, the replay DEALER's);
each HTTP connection one; the process a fixed reserve (ZMQ's context and I/O thread, the listening socket, logs,
the snapshot, Python's own).
"""

from __future__ import annotations

import resource

from kvtier.util.fields import ConfigError

PER_ENDPOINT = 6
RESERVE = 64


def needed(endpoints: int, max_connections: int) -> int:
    """Descriptors the service may hold at once with ``endpoints`` engine endpoints and ``max_connections``."""
    return RESERVE + PER_ENDPOINT * endpoints + max_connections


def ensure(endpoints: int, max_connections: int) -> int:
    """Raises the soft RLIMIT_NOFILE to what the service needs if it is lower and the hard limit allows; else
    :class:`ConfigError` in one line saying what is needed and how to lower it. Returns the soft limit in force."""
    want = needed(endpoints, max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    if hard != resource.RLIM_INFINITY and hard < want:
        raise ConfigError(f"open-files limit {hard} (hard) is below the {want} this service may need "
                          f"({endpoints} endpoint(s) x {PER_ENDPOINT} + max_connections {max_connections} "
                          f"+ {RESERVE}); raise it (ulimit -n) or lower max_connections")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"open-files limit: cannot raise the soft limit {soft} to {want}: {exc}") from None
    return want
