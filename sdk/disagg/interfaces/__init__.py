"""The abstract interfaces: `Fabric`, `Pool` and `Device` for drivers, `Composer` for clients."""

from disagg.interfaces.composer import Composer, ComposeResult
from disagg.interfaces.context import CallContext, epoch_announcement
from disagg.interfaces.fabric import (
    Device,
    EventHandler,
    Fabric,
    Pool,
    Subscription,
    check_allocations,
    check_bindings,
    check_id,
)
from disagg.interfaces.faults import FaultInjection

__all__ = [
    "CallContext",
    "ComposeResult",
    "Composer",
    "Device",
    "EventHandler",
    "Fabric",
    "FaultInjection",
    "Pool",
    "Subscription",
    "check_allocations",
    "check_bindings",
    "check_id",
    "epoch_announcement",
]
