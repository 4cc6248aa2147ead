"""A driver's claim on its state directory: one driver process per ``state_dir``.

Drivers that keep their hardware's processes and records in a directory (QEMU guests, a switch emulator) must
not share it: two would fight over one QEMU monitor, or one would stop the emulator the other is using. The
claim is a lock on ``<state_dir>/driver.lock`` (`disagg.lockfile`), which goes with the driver's process however it
ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from disagg.errors import ConfigError, FabricUnavailableError
from disagg.lockfile import try_lock


def claim(fabric: str, driver: str, state_dir: Path) -> IO[bytes]:
    """Make ``state_dir`` if need be and lock it for this fabric until the returned file is closed (close it in
    the fabric's ``close``); raises `FabricUnavailableError` while another driver holds it, and `ConfigError`
    when it cannot be a directory (a file is in the way, no permission)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
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
