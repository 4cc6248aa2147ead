"""A driver's claim on its state directory: one driver process per ``state_dir``.

Drivers that keep their hardware's processes and records in a directory (QEMU guests, a switch emulator) must
not share it: two would fight over one QEMU monitor, or one would stop the emulator the other is using. The
claim is a lock on ``<state_dir>/driver.lock`` (`disagg.lockfile`), which goes with the driver's process however it
ends. The lock file is its owner's alone (`disagg.lockfile`): another user who could open it could hold the lock,
and keep the driver or the fabric manager from starting. The directories made for it, as for a ledger or a socket,
are closed to other users (`DIRECTORY_MODE`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO

from disagg.errors import ConfigError, FabricUnavailableError
from disagg.lockfile import try_lock

DIRECTORY_MODE = 0o750
"""The mode of a directory this package makes (for a ledger, a driver's state or a socket), less what the umask
takes: never open to other users, whatever the umask; its group may pass through to a socket made beside the
ledger, which the socket's own mode then guards, while the ledger and the lock files in it are 0600."""


def make_directories(directory: Path, mode: int = DIRECTORY_MODE) -> None:
    """Create ``directory`` and its missing parents, each ``mode`` less the umask (``Path.mkdir`` gives the
    parents the umask's mode alone: 0o777 under umask 000). Directories that exist are left as they are."""
    missing: list[Path] = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            made.mkdir(mode=mode)


def claim(fabric: str, driver: str, state_dir: Path) -> IO[bytes]:
    """Make ``state_dir`` if need be and lock it for this fabric until the returned file is closed (close it in
    the fabric's ``close``); raises `FabricUnavailableError` while another driver holds it, and `ConfigError`
    when it cannot be a directory (a file is in the way, no permission)."""
    try:
        make_directories(state_dir)
        owner = try_lock(state_dir / "driver.lock")
    except OSError as exc:
        raise ConfigError(
            f"fabric {fabric!r} (driver {driver}): state_dir {state_dir} cannot be used: {exc}", field="state_dir"
        ) from None
    if owner is None:
        raise FabricUnavailableError(
            f"fabric {fabric!r}: another {driver} driver holds {state_dir}; one driver per state_dir"
        )
    return owner


def write_durably(path: Path, text: str) -> None:
    """Replace the file at ``path`` with ``text`` so that a crash leaves the old file or the new one, and once this
    returns the new one survives a power loss: written beside it, synced, renamed over it, and its directory
    synced. Raises OSError; the file beside it is removed on failure."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
