"""The ``qemu-cxl`` fabric: one QEMU per configured host, each with a CXL switch, and one memory pool carved
into Type-3 devices that are hot-added on the hosts' downstream ports.

The topology reported mirrors the sim's CXL appliance: a pool device hangs off an appliance switch that every
host's switch links to, so the composer places ``cxl-memory`` requests on any host. Each host switch lists
its downstream ports, with the Type-3 that QEMU holds on each.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from disagg.errors import ConfigError, DisaggError, FabricUnavailableError, NotFoundError, UnsupportedError
from disagg.interfaces import CallContext, EventHandler, Fabric, Pool, Subscription
from disagg.model import (
    Binding,
    Capabilities,
    DeviceKind,
    Feature,
    Host,
    Link,
    Port,
    PortKind,
    Switch,
    SwitchKind,
    Topology,
)
from disagg.model import Device as DeviceInfo
from disagg.statedir import claim, make_directories

from disagg_qemu_cxl.command import host_dir
from disagg_qemu_cxl.discovery import Features, HostView, probe
from disagg_qemu_cxl.hosts import HostProcess, find_qemu, reap_unconfigured, running_pid
from disagg_qemu_cxl.options import QemuCxlOptions, memory_bytes
from disagg_qemu_cxl.pool import Ledger, QemuCxlPool
from disagg_qemu_cxl.qmp import Loop
from disagg_qemu_cxl.state import State, StateFile

QEMU_CXL_CAPABILITIES = Capabilities(
    kinds=frozenset({DeviceKind.CXL_MEMORY}), features=frozenset({Feature.CARVE, Feature.FENCING})
)
"""No BIND (memory is carved, never bound whole) and no UNBIND: QEMU 7.2 never completes a CXL hot-remove."""
HOST_LINK_NS = 120
APPLIANCE_LINK_NS = 150


def check_records(fabric: str, options: QemuCxlOptions, state: State) -> None:
    """Refuse options that contradict the recorded allocations, before any QEMU is started or reaped. A host
    missing from the config whose QEMU still runs would have it, and the memory it holds, killed (a typo in its
    name is enough); one whose QEMU is gone loses nothing, so its records are kept, counted against the pool until
    released. A port beyond a host's ``ports`` would make its QEMU exit at start with only "Bus not found" to
    say, and no fabric to release the allocation from. A ``pool_bytes`` below what the allocations hold would
    leave less than nothing free (`check_pool_bytes`)."""
    configured = {h.name for h in options.hosts}
    pids = {h: running_pid(host_dir(options.state_dir, h)) for h in {r.host for r in state.records} - configured}
    running = {h: pid for h, pid in sorted(pids.items()) if pid is not None}
    if running:
        held = "; ".join(
            f"{h!r}: {', '.join(repr(r.allocation) for r in state.on_host(h))} (QEMU pid {pid})"
            for h, pid in running.items()
        )
        raise ConfigError(
            f"fabric {fabric!r} (driver qemu-cxl): option 'hosts': hosts that are not configured hold allocations "
            f"in QEMUs that still run ({held}), and starting would kill those QEMUs; restore each such host in the "
            "config (its QEMU is adopted) and release its allocations before removing it, or, to give that memory "
            "up, stop the QEMU (kill <pid>): its records are then kept, counted against the pool, until released",
            field="hosts",
        )
    for i, host in enumerate(options.hosts):
        beyond = sorted((r for r in state.cold_plugged(host.name) if r.port >= host.ports), key=lambda r: r.port)
        if beyond:
            held = ", ".join(f"allocation {r.allocation!r} holds dsp{r.port}" for r in beyond)
            raise ConfigError(
                f"fabric {fabric!r} (driver qemu-cxl): option 'hosts[{i}].ports': host {host.name!r} has "
                f"{host.ports} downstream ports (dsp0-dsp{host.ports - 1}), but {held}; set ports to at "
                f"least {beyond[-1].port + 1}, or release those allocations under the ports they were made with",
                field=f"hosts[{i}].ports",
            )
    check_pool_bytes(fabric, options, state)


def check_pool_bytes(fabric: str, options: QemuCxlOptions, state: State) -> None:
    """Refuse a ``pool_bytes`` smaller than the bytes the recorded allocations hold, or than the end of their
    blocks: QEMU, started with the smaller CXL window, would still take them all cold-plugged, and the pool
    report less than nothing free. The records that hold are those a start plugs (`State.cold_plugged`)."""
    holding = [r for r in state.records if r.plugged and not r.releasing]
    total = sum(r.size for r in holding)
    ends = {r.allocation: max((o + n for o, n in r.extents), default=0) for r in holding}
    need = max([total, *ends.values()])
    if need <= options.pool_bytes:
        return
    past = ", ".join(f"{a!r} (to byte {end})" for a, end in sorted(ends.items()) if end > options.pool_bytes)
    raise ConfigError(
        f"fabric {fabric!r} (driver qemu-cxl): option 'pool_bytes': the pool would hold {options.pool_bytes} "
        f"bytes, but the recorded allocations hold {total}"
        + (f" and these lie past its end: {past}" if past else "")
        + f"; set pool_bytes to at least {need}, or release those allocations under the pool_bytes they were made "
        "with",
        field="pool_bytes",
    )


class _NoEvents(Subscription):
    def cancel(self) -> None:
        return None


class QemuCxlFabric(Fabric):
    """Starts (or adopts) every configured host's QEMU on construction; `close` disconnects, and stops them too
    with ``stop_hosts_on_close``. A closed fabric refuses every call: it no longer owns ``state_dir``."""

    def __init__(self, name: str, options: QemuCxlOptions) -> None:
        self._name = name
        self._options = options
        find_qemu(options.qemu)
        try:
            make_directories(options.state_dir)  # closed to other users: it holds the memory backends
        except OSError as exc:  # a setting to mend, as `claim` says of one it cannot lock
            raise ConfigError(
                f"fabric {name!r} (driver qemu-cxl): state_dir {options.state_dir} cannot be used: {exc}",
                field="state_dir",
            ) from None
        self._lock = threading.RLock()
        self._closed = False
        self._owner = claim(name, "qemu-cxl", options.state_dir)
        self._loop = Loop(name)
        self._hosts: dict[str, HostProcess] = {}
        started: list[HostProcess] = []
        try:
            self._ledger = Ledger(StateFile(options.state_dir / "state.json"))
            check_records(name, options, self._ledger.state)
            self.reaped = reap_unconfigured(options.state_dir, [h.name for h in options.hosts])
            for host in options.hosts:
                process = HostProcess(options.qemu, host, options.state_dir, options.pool_bytes, self._loop)
                process.adopt_or_start(self._ledger.state.cold_plugged(host.name))
                self._hosts[host.name] = process
                if not process.adopted:
                    started.append(process)
            self._features = probe(next(iter(self._hosts.values())).monitor)
        except BaseException:
            for process in self._hosts.values():
                with contextlib.suppress(DisaggError):
                    if process in started:
                        process.stop()
                    else:
                        process.disconnect()
            self._loop.close()
            self._owner.close()
            raise
        self._pool = QemuCxlPool(
            name,
            pool_bytes=options.pool_bytes,
            hosts=self._hosts,
            ledger=self._ledger,
            lock=self._lock,
            features=lambda: self._features,
            state_dir=options.state_dir,
        )
        self._pool.read_adopted([name for name, process in self._hosts.items() if process.adopted])

    def _check_open(self) -> None:
        if self._closed:
            raise FabricUnavailableError(f"fabric {self._name} is closed")

    @property
    def name(self) -> str:
        return self._name

    @property
    def features(self) -> Features:
        """What the QEMU binary offers (volatile Type-3 memory, ``cxl-*`` QMP commands), probed over QMP."""
        return self._features

    @property
    def hosts(self) -> dict[str, HostProcess]:
        return dict(self._hosts)

    def capabilities(self) -> Capabilities:
        self._check_open()
        return QEMU_CXL_CAPABILITIES

    def discover(self) -> Topology:
        self._check_open()
        return self._topology(self._pool.views())

    def _topology(self, views: dict[str, HostView]) -> Topology:
        fabric = self._name
        appliance = f"{fabric}/cxl-appliance"
        hosts: list[Host] = []
        switches: list[Switch] = []
        links: list[Link] = []
        for name, process in sorted(self._hosts.items()):
            switch = f"{fabric}/{name}-switch"
            view = views[name]
            ports = [Port("usp", PortKind.UPSTREAM, connected=name)]
            for index in sorted(view.ports):
                held = view.on_port(index)
                ports.append(Port(f"dsp{index}", PortKind.DOWNSTREAM, connected=held[0].id if held else ""))
            ports.append(Port("fabric", PortKind.FABRIC, connected=appliance))
            switches.append(
                Switch(switch, fabric, SwitchKind.CXL, vendor="QEMU", model="cxl-upstream", ports=tuple(ports))
            )
            hosts.append(
                Host(
                    name,
                    memory_bytes=memory_bytes(process.options.memory),
                    switch=switch,
                    attributes={"qemu_pid": process.pid or 0, "cxl_ports": process.options.ports},
                )
            )
            links.append(Link(name, switch, HOST_LINK_NS))
            links.append(Link(switch, appliance, APPLIANCE_LINK_NS))
        fabric_ports = tuple(Port(f"p{i}", PortKind.FABRIC, connected=s.id) for i, s in enumerate(switches))
        switches.append(
            Switch(appliance, fabric, SwitchKind.CXL, vendor="QEMU", model="memory-backend-file", ports=fabric_ports)
        )
        info = self._pool.info()
        device = DeviceInfo(
            id=info.device,
            fabric=fabric,
            kind=DeviceKind.CXL_MEMORY,
            serial=f"QEMU-CXL-{fabric}",
            vendor="QEMU",
            model="cxl-type3",
            switch=appliance,
            link_latency_ns=APPLIANCE_LINK_NS,
            attributes={"cxl_type": 3, "media": "volatile" if self._features.volatile else "persistent"},
            capacity=info.capacity,
        )
        return Topology(
            fabric, hosts=tuple(hosts), switches=tuple(switches), devices=(device,), links=tuple(links), pools=(info,)
        )

    def bindings(self) -> Sequence[Binding]:
        self._check_open()
        return ()

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        with ctx.hold(self._lock, "the fabric"):
            self._check_open()
            self._ledger.fence(ctx)
        raise UnsupportedError(f"fabric {self._name} carves CXL memory from its pool; nothing is bound whole")

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        """Nothing is ever bound, so every unbind is of an absent binding: a no-op that still fences."""
        with ctx.hold(self._lock, "the fabric"):
            self._check_open()
            self._ledger.fence(ctx)

    def pool(self, pool: str) -> Pool:
        self._check_open()
        if pool != self._pool.id:
            raise NotFoundError("pool", pool)
        return self._pool

    def subscribe(self, handler: EventHandler) -> Subscription:
        self._check_open()
        return _NoEvents()

    def stop_hosts(self) -> None:
        """Quit every host's QEMU (their Type-3 devices go with them; the backend files and the state file
        stay, so the next start cold-plugs them again)."""
        with self._pool.every_host(), self._lock:
            self._check_open()
            for process in self._hosts.values():
                process.stop()

    def close(self) -> None:
        with self._pool.every_host(), self._lock:
            if self._closed:
                return
            self._closed = True
            self._pool.close()
            for process in self._hosts.values():
                with contextlib.suppress(DisaggError):
                    if self._options.stop_hosts_on_close:
                        process.stop()
                    else:
                        process.disconnect()
            self._loop.close()
            self._owner.close()
