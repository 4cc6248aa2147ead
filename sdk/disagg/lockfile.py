"""An exclusive lock on a file, for the one process (or open file) that may use what it guards.

The lock is an ``flock``: it belongs to the open file, so the kernel drops it when that file is closed or its
process ends, however it ends, and a restarted holder always gets it back. Drivers claim their state directory
with it (`disagg.statedir`), and a SQLite ledger's process claims the ledger (`disagg.store.ownership`).
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO


def try_lock(path: Path) -> IO[bytes] | None:
    """``path`` opened (made if need be) and locked, to be closed to let go; None while another holds it. Raises
    OSError when it cannot be opened."""
    owner = open(path, "a+b")  # noqa: SIM115 (the caller holds it for as long as it holds the lock)
    try:
        fcntl.flock(owner.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner.close()
        return None
    return owner
