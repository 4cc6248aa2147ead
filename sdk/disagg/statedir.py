"""A driver's claim on its state directory: one driver process per ``state_dir``.

Drivers that keep their hardware's processes and records in a directory (QEMU guests, a switch emulator) must
not share it: two would fight over one QEMU monitor, or one would stop the emulator the other is using. The
claim is an ``flock`` on ``<state_dir>/driver.lock``, which the kernel drops when the process dies, however it
dies, so a restarted driver always gets it back.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from disagg.errors import ConfigError, FabricUnavailableError


def claim(fabric: str, driver: str, state_dir: Path) -> IO[bytes]:
    """Make ``state_dir`` if need be and lock it for this fabric until the returned file is closed (close it in
    the fabric's ``close``); raises `FabricUnavailableError` while another driver holds it, and `ConfigError`
    when it cannot be a directory (a file is in the way, no permission)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        owner = open(state_dir / "driver.lock", "ab")  # noqa: SIM115 (held for the fabric's life, closed in close)
    except OSError as exc:
        raise ConfigError(
            f"fabric {fabric!r} (driver {driver}): state_dir {state_dir} cannot be used: {exc}", field="state_dir"
        ) from None
    try:
        fcntl.flock(owner.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner.close()
        raise FabricUnavailableError(
            f"fabric {fabric!r}: another {driver} driver holds {state_dir}; one driver per state_dir"
        ) from None
    return owner
