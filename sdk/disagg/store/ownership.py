"""Which process holds a SQLite ledger: one at a time, named in ``<ledger>.lock``.

Two fabric managers on one ledger (a second `disagg serve`, or a CLI command without --server beside a
running one) would each place on devices the other holds and fail each other's writes. So opening a ledger
locks its lock file (`disagg.lockfile`), which goes with the process however it ends. Stores
of one process share the hold (a restarted manager opened beside the old one in a test, a library user who
builds a new composer before closing the old): the lock is let go when the last of them closes, and not when
the first does, as a POSIX record lock would be.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import IO

from disagg.errors import ConfigError
from disagg.lockfile import try_lock

_lock = threading.Lock()
_held: dict[Path, tuple[IO[bytes], int]] = {}
"""Per lock file of this process: the open, locked file and how many open stores share it."""


def hold(ledger: Path) -> Path:
    """Hold ``ledger`` for this process; returns the key to give to `let_go`. Raises `ConfigError` while another
    process holds it, naming that process, and OSError when the lock file cannot be opened or written (a full
    disk: the caller says what that means), with nothing of it left open.

    The lock is named from the ledger's real path, symlinks resolved: one ledger named two ways (a symlink to it,
    or to its directory) must be one lock, or two processes would hold it."""
    try:
        real = ledger.resolve()
    except RuntimeError as exc:  # a symlink loop
        raise OSError(errno.ELOOP, str(exc), str(ledger)) from exc
    key = real.with_name(real.name + ".lock")
    with _lock:
        if key in _held:
            owner, count = _held[key]
            _held[key] = (owner, count + 1)
            return key
        found = try_lock(key)
        if found is None:
            holder = key.read_text(errors="replace").strip()[:32] or "unknown"
            raise ConfigError(
                f"the ledger at {ledger} is in use by another fabric manager (pid {holder}): reach that one with "
                "--server, or stop it first",
                field="state.path",
            )
        try:
            found.truncate(0)
            found.write(f"{os.getpid()}\n".encode())
            found.flush()
        except OSError:
            with contextlib.suppress(OSError):  # what the write left buffered fails to flush again; closed still
                found.close()
            raise
        _held[key] = (found, 1)
        return key


def share(key: Path) -> Path:
    """One more share of the hold ``key`` names (this process holds it: `hold` returned it), for `let_go`."""
    with _lock:
        owner, count = _held[key]
        _held[key] = (owner, count + 1)
    return key


def in_place(key: Path) -> bool:
    """Whether the lock file at ``key`` (held by this process) is still the one it locked. One removed (with the
    ledger's directory) or replaced holds no lock: another process would lock the new file and open the ledger
    beside this one, so the holder must stop using it."""
    with _lock:
        owner, _ = _held[key]
        held = os.fstat(owner.fileno())
    try:
        found = os.stat(key)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def let_go(key: Path) -> None:
    """One store of this process closed the ledger; the last one lets the next process have it."""
    with _lock:
        owner, count = _held[key]
        if count > 1:
            _held[key] = (owner, count - 1)
            return
        del _held[key]
        owner.close()
