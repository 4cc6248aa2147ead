"""What both of the switch's pools share, so that the DCD and the MLD answer alike: the checks before a carve (the
Pool contract's errors, in its order, before anything is sent to the switch), and the error for a command their
device refused."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from disagg.errors import ConflictError, DeviceBusyError, FabricUnavailableError, InvalidRequestError
from disagg.interfaces import CallContext, Pool, check_id
from disagg.model import Allocation, Health

from disagg_cxl_switch.driver.client import CommandFailedError

if TYPE_CHECKING:
    from disagg_cxl_switch.driver.fabric import CxlSwitchFabric


UNRECORDED = re.compile(r"ld-[0-9]+|tag-[0-9a-f]{32}")
"""The names the pools list memory by that the driver holds no record of (an LD bound by another manager, a
tag it did not set): an allocation id of one of these forms would be taken for that memory, by an allocate that
then carved nothing and by a release that freed it."""


def admit(
    fabric: CxlSwitchFabric,
    pool: Pool,
    allocation_id: str,
    host: str,
    amount_bytes: int,
    *,
    device: str,
    ctx: CallContext,
) -> tuple[int, int]:
    """Fence; refuse an allocation id or host that is not an id (`check_id`), an amount that is not positive, an
    unknown or unreachable host, a failed ``device`` (the pool's). The host's VCS id and the amount rounded up to
    whole blocks. The device is checked before the pool's geometry is read, which a device failed since the
    driver started may not have given yet."""
    fabric.state.fence(ctx.epoch)
    check_id(allocation_id, "allocation_id")
    if UNRECORDED.fullmatch(allocation_id):
        raise InvalidRequestError(
            f"allocation id {allocation_id!r} has the form this driver names memory by that it holds no record of "
            "(ld-<n>, tag-<32 hex digits>): another manager's, say; choose another id",
            field="allocation_id",
        )
    check_id(host, "host")
    if amount_bytes <= 0:
        raise InvalidRequestError(f"allocation {allocation_id}: amount {amount_bytes} is not positive")
    vcs = fabric.check_host(host)
    if fabric.port_view(fabric.view.port_of[device]).health is not Health.OK:
        raise DeviceBusyError(f"{device}, the device of pool {pool.id}, is failed")
    return vcs, pool.info().capacity.round_up(amount_bytes)


def tunnel_error(exc: CommandFailedError, what: str) -> FabricUnavailableError:
    """A command tunnelled to a pool's device that the device or the switch refused: Retry Required (its link is
    down), Invalid Input (no device behind the port: it was pulled), Busy, Internal Error. The driver builds
    every payload from what it read, so none is the caller's mistake: the fabric is failing (retry once the
    device is back)."""
    return FabricUnavailableError(f"{what}: {exc.message}")


def already_held(held: Iterable[Allocation], allocation_id: str, host: str, amount: int) -> Allocation | None:
    """The allocation ``allocation_id`` when it is held for ``host`` with ``amount``; None when it is not held;
    `ConflictError` when it is held otherwise."""
    for existing in held:
        if existing.id == allocation_id:
            if existing.host == host and existing.amount_bytes == amount:
                return existing
            held_for = f"{existing.host} ({existing.amount_bytes} bytes)"
            raise ConflictError(f"allocation {allocation_id} exists for {held_for}")
    return None
