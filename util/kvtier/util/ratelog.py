"""Logging for bad input that may repeat: every occurrence is counted (by the caller, for metrics),
only a few reach the log, so a flood of malformed frames or events cannot drown it."""

from __future__ import annotations

FIRST, EVERY = 10, 1000  # log occurrences 1..FIRST, then every EVERY-th


def worth_logging(count: int) -> bool:
    """True for the ``count``-th occurrence (1-based) if it should be logged. O(1)."""
    return count <= FIRST or count % EVERY == 0


def suffix(count: int, counted_in: str | None = "/metrics") -> str:
    """Tells the reader the log is thinned out from here on, and where every occurrence is counted (None: nowhere
    but in the log's own count)."""
    if count == FIRST:
        return f" (further ones logged every {EVERY}th{f'; all are counted in {counted_in}' if counted_in else ''})"
    return f" ({count} so far)" if count > FIRST else ""
