"""What both of the switch's pools check before they carve, so that the DCD and the MLD answer a bad or repeated
`allocate` alike: the Pool contract's errors, in its order, before anything is sent to the switch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from disagg.errors import ConflictError, DeviceBusyError, InvalidRequestError
from disagg.interfaces import CallContext
from disagg.model import Allocation, Health, PoolInfo

if TYPE_CHECKING:
    from disagg_cxl_switch.driver.fabric import CxlSwitchFabric


def admit(
    fabric: CxlSwitchFabric, info: PoolInfo, allocation_id: str, host: str, amount_bytes: int, *, ctx: CallContext
) -> tuple[int, int]:
    """Fence; refuse an amount that is not positive, an unknown or unreachable host, a failed device. The host's
    VCS id and the amount rounded up to whole blocks."""
    fabric.state.fence(ctx.epoch)
    if amount_bytes <= 0:
        raise InvalidRequestError(f"allocation {allocation_id}: amount {amount_bytes} is not positive")
    vcs = fabric.check_host(host)
    if fabric.port_view(fabric.view.port_of[info.device]).health is not Health.OK:
        raise DeviceBusyError(f"{info.device}, the device of pool {info.id}, is failed")
    return vcs, info.capacity.round_up(amount_bytes)


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
