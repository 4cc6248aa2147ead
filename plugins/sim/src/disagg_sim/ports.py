"""Switch ports derived from links and devices, so that every topology source reports the same port layout.

A simulated switch has exactly the ports its cabling needs, numbered ``p0, p1, ...`` in this order: one per
link (UPSTREAM when the far end is a host, FABRIC when it is another switch), in link order, then one
DOWNSTREAM port per attached device, in device order. A port is up when its link is up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
from disagg.model import Device, Link, Port, PortKind, Switch


def wire_ports(switches: Sequence[Switch], links: Iterable[Link], devices: Iterable[Device]) -> tuple[Switch, ...]:
    """The switches with their ``ports`` filled in from ``links`` and ``devices``."""
    index = {s.id: i for i, s in enumerate(switches)}
    ports: list[list[Port]] = [[] for _ in switches]

    def add(switch: str, kind: PortKind, connected: str, up: bool) -> None:
        i = index[switch]
        ports[i].append(Port(id=f"p{len(ports[i])}", kind=kind, connected=connected, up=up))

    for link in links:
        a_is_switch, b_is_switch = link.a in index, link.b in index
        if a_is_switch:
            add(link.a, PortKind.FABRIC if b_is_switch else PortKind.UPSTREAM, link.b, link.up)
        if b_is_switch:
            add(link.b, PortKind.FABRIC if a_is_switch else PortKind.UPSTREAM, link.a, link.up)
    for device in devices:
        if device.switch in index:
            add(device.switch, PortKind.DOWNSTREAM, device.id, True)
    return tuple(attrs.evolve(s, ports=tuple(p)) for s, p in zip(switches, ports, strict=True))
