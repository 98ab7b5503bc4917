"""Whether a process id names a live process: what decides that a temporary file named for its writer's pid was
left by a writer that is gone (the indexer's snapshots, the L3 store's pages)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts). A pid past the largest the system takes
    names none. O(1)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # it exists, another user's
        return True
    return True
