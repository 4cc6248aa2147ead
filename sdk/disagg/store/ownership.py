"""Which process holds a SQLite ledger: one at a time, named in ``<ledger>.lock``.

Two fabric managers on one ledger (a second `disagg serve`, or a CLI command without --server beside a
running one) would each place on devices the other holds and fail each other's writes. So opening a ledger
takes an ``flock`` on its lock file, which the kernel drops when the process ends, however it ends. Stores
of one process share the hold (a restarted manager opened beside the old one in a test, a library user who
builds a new composer before closing the old): the lock is let go when the last of them closes, and not when
the first does, as a POSIX record lock would be.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from disagg.errors import ConfigError

_lock = threading.Lock()
_held: dict[Path, tuple[int, int]] = {}
"""Per lock file of this process: its descriptor and how many open stores share it."""


def hold(ledger: Path) -> Path:
    """Hold ``ledger`` for this process; returns the key to give to `let_go`. Raises `ConfigError` while another
    process holds it, naming that process."""
    key = ledger.with_name(ledger.name + ".lock").resolve()
    with _lock:
        if key in _held:
            fd, count = _held[key]
            _held[key] = (fd, count + 1)
            return key
        try:
            fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot open the ledger at {ledger}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"the ledger at {ledger} is in use by another fabric manager (pid {holder}): reach that one with "
                "--server, or stop it first",
                field="state.path",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = (fd, 1)
        return key


def let_go(key: Path) -> None:
    """One store of this process closed the ledger; the last one lets the next process have it."""
    with _lock:
        fd, count = _held[key]
        if count > 1:
            _held[key] = (fd, count - 1)
            return
        del _held[key]
        os.close(fd)
