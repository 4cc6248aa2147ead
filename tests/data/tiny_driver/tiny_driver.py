"""A minimal third-party driver: one host and a handful of GPUs on one switch, all in memory."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from disagg import hookimpl
from disagg.errors import ConfigError, DeviceBusyError, UnknownDeviceError, UnknownHostError
from disagg.interfaces import CallContext, EventHandler, Fabric, Subscription
from disagg.model import Binding, Capabilities, Device, DeviceKind, Feature, Host, Switch, Topology, device_id

CAPABILITIES = Capabilities(kinds={DeviceKind.GPU}, features={Feature.BIND, Feature.UNBIND})


class _NoEvents(Subscription):
    def cancel(self) -> None:
        return None


class TinyFabric(Fabric):
    def __init__(self, name: str, gpus: int) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._bound: dict[str, str] = {}
        switch = device_id(name, "sw")
        self._topology = Topology(
            fabric=name,
            hosts=(Host("tiny-host", cores=16, memory_bytes=64 << 30, switch=switch),),
            switches=(Switch(switch, name),),
            devices=tuple(
                Device(device_id(name, f"gpu{i}"), name, DeviceKind.GPU, f"TINY-{i:04d}", "Tiny", "T1", switch, 100)
                for i in range(gpus)
            ),
        )

    @property
    def name(self) -> str:
        return self._name

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def discover(self) -> Topology:
        return self._topology

    def bindings(self) -> Sequence[Binding]:
        with self._lock:
            return [Binding(d, h) for d, h in sorted(self._bound.items())]

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if device not in {d.id for d in self._topology.devices}:
            raise UnknownDeviceError(device)
        if host != "tiny-host":
            raise UnknownHostError(host)
        ctx.check_deadline()  # a caller that gave up must not find the device bound later
        with self._lock:
            holder = self._bound.setdefault(device, host)
        if holder != host:
            raise DeviceBusyError(f"{device} is bound to {holder}")
        return Binding(device, host)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        ctx.check_deadline()
        with self._lock:
            if self._bound.get(binding.device) == binding.host:
                del self._bound[binding.device]

    def subscribe(self, handler: EventHandler) -> Subscription:
        return _NoEvents()


def create(name: str, options: Mapping[str, Any]) -> TinyFabric:
    gpus = options.get("gpus", 4)
    if set(options) - {"gpus"} or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"tiny fabric {name}: the only option is gpus, a positive integer")
    return TinyFabric(name, gpus)


@hookimpl
def disagg_register_drivers(registry: Any) -> None:
    registry.add_driver("tiny", create, capabilities=CAPABILITIES, description="a tiny in-memory GPU box")
