"""An exclusive lock on a file, for the one process (or open file) that may use what it guards.

The lock is an ``flock``: it belongs to the open file, so the kernel drops it when that file is closed or its
process ends, however it ends, and a restarted holder always gets it back. Drivers claim their state directory
with it (`disagg.statedir`), and a SQLite ledger's process claims the ledger (`disagg.store.ownership`).

An ``flock`` needs no more than a descriptor open for reading, so a lock file others may read is one any local
user can lock, keeping its owner from starting: lock files are made `LOCK_FILE_MODE`, and one found more open
(made by an older version, or under another umask) is closed to others as it is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_FILE_MODE = 0o600
"""A lock file's mode: its owner's alone."""


def try_lock(path: Path) -> IO[bytes] | None:
    """``path`` opened (made `LOCK_FILE_MODE` if need be) and locked, to be closed to let go; None while another
    holds it. Raises OSError when it cannot be opened, and ValueError for a path holding a NUL."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, LOCK_FILE_MODE)
    owner = open(fd, "a+b")  # noqa: SIM115 (the caller holds it for as long as it holds the lock)
    with contextlib.suppress(OSError):  # another user's file is its owner's to close
        if os.fstat(fd).st_mode & 0o777 & ~LOCK_FILE_MODE:
            os.fchmod(fd, LOCK_FILE_MODE)
    try:
        fcntl.flock(owner.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner.close()
        return None
    return owner
