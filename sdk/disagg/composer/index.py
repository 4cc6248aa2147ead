"""The inventory index: every fabric's devices grouped so that placement never scans single devices.

Devices of one kind with the same vendor, model, attributes, failure domains and last-hop latency on one
switch are interchangeable: they form a *bucket* whose free members sit in a sorted list. Each host knows
the switches it reaches, sorted by fabric latency. Placement walks a host's switches nearest first and
looks at buckets only, so its cost follows the size of the host's fabric domain, not of the whole fabric.

The sorted lists (a bucket's free devices, the free hosts by size) are plain lists kept sorted by bisection.
A claim moves the list's tail in memory, in C: for a bucket, one switch's ports of a kind; for the hosts, 8
bytes a host, about 0.1 MB at 100,000 devices. `sortedcontainers.SortedList` bounds that move but does its
bookkeeping in Python, which cost more at every size measured (docs/benchmarks.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import attrs

from disagg.errors import ConfigError
from disagg.model import Device, DeviceKind, Health, Host, PoolInfo, Topology, switch_reach


@attrs.define
class Bucket:
    """Interchangeable devices on one switch; ``free`` holds the ids not claimed and healthy, sorted."""

    key: int
    switch: str
    kind: DeviceKind
    exemplar: Device
    free: list[str] = attrs.field(factory=list)

    @property
    def link_latency_ns(self) -> int:
        return self.exemplar.link_latency_ns

    @property
    def failure_domains(self) -> Mapping[str, str]:
        return self.exemplar.failure_domains


@attrs.define
class PoolState:
    """A carved pool: its static description, the switch it hangs off, its free bytes, and for an MLD how many
    more allocations it takes (one per logical device), since free bytes alone would offer a pool whose LDs are
    all used; None for a pool that takes any number (a DCD). ``excess_bytes``: what claims hold beyond the
    capacity (the hardware carved more than the ledger knew of), cancelled first by releases, so that the free
    bytes never go below zero yet stay those no claim holds."""

    info: PoolInfo
    device: Device
    free_bytes: int
    free_lds: int | None = None
    excess_bytes: int = 0


def _signature(device: Device) -> tuple[object, ...]:
    return (
        device.switch,
        device.kind,
        device.vendor,
        device.model,
        tuple(sorted(device.attributes.items())),
        tuple(sorted(device.failure_domains.items())),
        device.link_latency_ns,
    )


K = TypeVar("K", str, tuple[int, int, str])
"""What the index keeps sorted: device ids, and hosts as (cores, memory, id)."""


def _find(items: list[K], item: K) -> tuple[int, bool]:
    """Where ``item`` is, or would go, in the sorted ``items``, and whether it is there."""
    at = bisect_left(items, item)
    return at, at < len(items) and items[at] == item


def _merge_hosts(topologies: Iterable[Topology]) -> dict[str, Host]:
    hosts: dict[str, Host] = {}
    for topo in topologies:
        for host in topo.hosts:
            seen = hosts.get(host.id)
            if seen is None or (not seen.cores and not seen.memory_bytes):
                hosts[host.id] = attrs.evolve(host, switch="")
            elif (host.cores or host.memory_bytes) and (seen.cores, seen.memory_bytes) != (
                host.cores,
                host.memory_bytes,
            ):
                raise ConfigError(
                    f"host {host.id!r} is described differently by two fabrics "
                    f"({seen.cores} cores/{seen.memory_bytes} B vs {host.cores} cores/{host.memory_bytes} B)"
                )
    return hosts


def _reported_twice(what: str, item: str, first: str, second: str) -> ConfigError:
    """The refusal of an id reported twice, by the fabrics ``first`` and ``second`` (or twice by one)."""
    by = f"fabric {first!r}" if first == second else f"fabrics {first!r} and {second!r}"
    return ConfigError(
        f"{what} id {item!r} is reported twice (by {by}); device, switch and pool ids are <fabric>/<local id>, "
        "unique in the fabric"
    )


def _reporter(topologies: Iterable[Topology], device: str) -> str:
    """The fabric that reported ``device`` first: for the refusal of a repeat, never on the way of a rebuild."""
    return next(t.fabric for t in topologies for d in t.devices if d.id == device)


@attrs.frozen
class Repeat:
    """An id reported more than once: what it names (``device``, ``switch`` or ``pool``), the id, and the
    fabric of each report, in the order of the topologies (one fabric twice when it repeats the id itself)."""

    what: str
    id: str
    fabrics: tuple[str, ...]


def reported_ids(topology: Topology) -> set[str]:
    """The device, switch and pool ids ``topology`` reports: the ids `Inventory` requires unique."""
    return {
        *(d.id for d in topology.devices),
        *(s.id for s in topology.switches),
        *(p.id for p in topology.pools),
    }


def repeated_ids(topologies: Iterable[Topology]) -> list[Repeat]:
    """Every device, switch and pool id that ``topologies`` report more than once, the ids `Inventory` refuses:
    found without refusing, so that the composer can set aside the fabric whose report repeats one at run time
    and keep indexing the others (`FabricComposer._index`)."""
    reports: dict[tuple[str, str], list[str]] = defaultdict(list)
    for topo in topologies:
        for what, ids in (
            ("device", [d.id for d in topo.devices]),
            ("switch", [s.id for s in topo.switches]),
            ("pool", [p.id for p in topo.pools]),
        ):
            for item in ids:
                reports[(what, item)].append(topo.fabric)
    return [Repeat(what, item, tuple(fabrics)) for (what, item), fabrics in reports.items() if len(fabrics) > 1]


def _refuse_shared_switches(topologies: Iterable[Topology]) -> None:
    """Refuse a switch id that two fabrics report. The index joins hosts to devices by switch id alone: were
    both to call a switch ``sw0``, the hosts of one would be offered the other's devices, which it cannot bind
    to them (a fabric that lists one switch twice joins nothing it should not)."""
    reporter: dict[str, str] = {}
    for topo in topologies:
        for switch in topo.switches:
            first = reporter.setdefault(switch.id, topo.fabric)
            if first != topo.fabric:
                raise _reported_twice("switch", switch.id, first, topo.fabric)


class Inventory:
    """The indexed view of all fabrics plus who holds what. Not thread-safe: the composer locks around it."""

    def __init__(self, topologies: Sequence[Topology]) -> None:
        self.topologies = {t.fabric: t for t in topologies}
        self.hosts = _merge_hosts(topologies)
        self.devices: dict[str, Device] = {}
        self.pools: dict[str, PoolState] = {}
        self.reach: dict[str, list[tuple[int, str]]] = {}
        self.reach_map: dict[str, dict[str, int]] = {}
        self.switch_hosts: dict[str, set[str]] = defaultdict(set)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[str, Bucket] = {}
        self.by_switch_kind: dict[tuple[str, DeviceKind], list[Bucket]] = defaultdict(list)
        self.by_kind: dict[DeviceKind, list[Bucket]] = defaultdict(list)
        self.pools_by_switch: dict[str, list[PoolState]] = defaultdict(list)
        self.owner: dict[str, str] = {}
        self.cordoned: set[str] = set()
        self.host_owner: dict[str, str] = {}
        self.host_free: dict[str, dict[DeviceKind, int]] = {h: defaultdict(int) for h in self.hosts}
        self.free_hosts: list[tuple[int, int, str]] = []
        """(cores, memory, id) of every host no composition holds, sorted: smallest first."""
        self._offered_at = 0
        """Where in `free_hosts` `hosts_from` found the host it offered last: `claim_host` looks there first, since
        a Compose claims the host that placement chose, and searches only if another host is there now."""

        merged: dict[str, dict[str, int]] = defaultdict(dict)
        for topo in topologies:
            for host, switches in switch_reach(topo).items():
                merged[host].update(switches)
        for host, switches in merged.items():
            self.reach[host] = sorted((lat, sw) for sw, lat in switches.items())
            self.reach_map[host] = switches
            for sw in switches:
                self.switch_hosts[sw].add(host)

        carved = {p.device for t in topologies for p in t.pools}
        members: dict[tuple[object, ...], list[Device]] = defaultdict(list)
        for topo in topologies:
            for device in topo.devices:
                if device.id in self.devices:
                    raise _reported_twice("device", device.id, _reporter(topologies, device.id), topo.fabric)
                self.devices[device.id] = device
                if device.id not in carved:
                    members[_signature(device)].append(device)
        # Bucket keys follow the smallest device id of each bucket, so that ties between buckets break the
        # same way whatever order the drivers list their devices in.
        for group in sorted(members.values(), key=lambda devs: min(d.id for d in devs)):
            exemplar = min(group, key=lambda d: d.id)
            bucket = Bucket(len(self.buckets), exemplar.switch, exemplar.kind, exemplar)
            self.buckets.append(bucket)
            self.by_switch_kind[(exemplar.switch, exemplar.kind)].append(bucket)
            self.by_kind[exemplar.kind].append(bucket)
            for device in group:
                self.bucket_of[device.id] = bucket
            bucket.free = sorted(d.id for d in group if d.health is Health.OK)
            for host in self.switch_hosts.get(bucket.switch, ()):
                self.host_free[host][bucket.kind] += len(bucket.free)
        _refuse_shared_switches(topologies)  # after the devices: a fabric listed twice is named by its devices
        pool_reporter: dict[str, str] = {}
        for topo in topologies:
            for pool in topo.pools:
                dev = self.devices.get(pool.device)
                if dev is None:
                    raise ConfigError(f"pool {pool.id!r} names unknown device {pool.device!r}")
                if pool.id in pool_reporter:  # a second pool of the id would hide the first, and carve from it
                    raise _reported_twice("pool", pool.id, pool_reporter[pool.id], topo.fabric)
                pool_reporter[pool.id] = topo.fabric
                self._add_pool(pool, dev)
        self.free_hosts = sorted((h.cores, h.memory_bytes, h.id) for h in self.hosts.values())
        self._free_counts: dict[str, list[dict[DeviceKind, int]]] = {
            sw: [self.host_free[h] for h in hosts] for sw, hosts in self.switch_hosts.items()
        }
        """Per switch, the free counts of the hosts that reach it: what claiming one of its devices changes."""
        self.device_ids: list[str] = sorted(self.devices)
        """Every device id in order, sorted once here so that listings do not sort on every call."""

    def _set_free(self, device: str, free: bool) -> None:
        bucket = self.bucket_of[device]
        if free and device in self.cordoned:
            return
        ids = bucket.free
        at = bisect_left(ids, device)  # `_find`, without its frame: per device a Compose claims
        present = at < len(ids) and ids[at] == device
        if free == present:  # nothing changes, and the hosts' counts stay what the list holds
            return
        if free:
            ids.insert(at, device)
        else:
            del ids[at]
        delta = 1 if free else -1
        kind = bucket.kind
        for counts in self._free_counts.get(bucket.switch, ()):
            counts[kind] += delta

    def cordon(self, device: str) -> None:
        """Keep a device out of placement (a pool's device: the pool, `Placer` skips it); whoever holds it
        keeps it."""
        if self.is_free(device):
            self._set_free(device, False)
        self.cordoned.add(device)

    def uncordon(self, device: str) -> None:
        if device not in self.cordoned:
            return
        self.cordoned.discard(device)
        dev = self.devices.get(device)
        if dev is not None and dev.health is Health.OK and device not in self.owner and device in self.bucket_of:
            self._set_free(device, True)

    def is_free(self, device: str) -> bool:
        bucket = self.bucket_of.get(device)
        return bucket is not None and _find(bucket.free, device)[1]

    def claim_device(self, device: str, owner: str) -> None:
        """Take a device out of the free pool for ``owner``; a failed device may be claimed (on reload)."""
        current = self.owner.get(device)
        if current == owner:
            return
        if current is not None:
            raise ValueError(f"device {device} is held by {current}, not free for {owner}")
        if device in self.bucket_of:  # `_set_free` leaves a device that is not free as it is
            self._set_free(device, False)
        self.owner[device] = owner

    def release_device(self, device: str) -> None:
        if self.owner.pop(device, None) is None:
            return
        dev = self.devices.get(device)
        if dev is not None and dev.health is Health.OK and device in self.bucket_of:
            self._set_free(device, True)

    def claim_memory(self, pool: str, amount: int) -> None:
        """Take one allocation of ``amount`` bytes out of ``pool``: its bytes and, in an MLD, a logical device.

        Never raises for want of room: a rebuild and reconciliation claim what the hardware holds, which may be
        more than the ledger left free (a ledger restored from a backup); the bytes beyond the free ones are kept
        as ``excess_bytes``. The LD count may likewise go below zero: the driver, not the index, refuses an LD
        too many; placement offers the pool again only once enough are released."""
        state = self.pools[pool]
        beyond = max(0, amount - state.free_bytes)
        state.free_bytes -= amount - beyond
        state.excess_bytes += beyond
        if state.free_lds is not None:
            state.free_lds -= 1

    def release_memory(self, pool: str, amount: int) -> None:
        """Give back one allocation that `claim_memory` took."""
        state = self.pools.get(pool)
        if state is not None:
            cancelled = min(amount, state.excess_bytes)
            state.excess_bytes -= cancelled
            state.free_bytes = min(state.info.capacity.total_bytes, state.free_bytes + amount - cancelled)
            lds = state.info.ld_count
            if state.free_lds is not None and lds is not None:
                state.free_lds = min(lds, state.free_lds + 1)

    def resize_pool(self, info: PoolInfo) -> None:
        """Take the description a pool's fabric reports now (its capacity, block size or logical devices changed),
        its claims kept exactly: what they hold is free no more, and what they hold beyond the new capacity is
        kept as ``excess_bytes`` (and an MLD's logical devices may go below zero), as `claim_memory` keeps it."""
        state = self.pools[info.id]
        held = state.info.capacity.total_bytes - state.free_bytes + state.excess_bytes
        total = info.capacity.total_bytes
        state.free_bytes, state.excess_bytes = max(0, total - held), max(0, held - total)
        before, after = state.info.ld_count, info.ld_count
        if state.free_lds is not None and before is not None and after is not None:
            state.free_lds += after - before
        state.info = info

    def _add_pool(self, info: PoolInfo, device: Device) -> None:
        state = PoolState(info, device, info.capacity.total_bytes, info.ld_count)
        self.pools[info.id] = state
        self.pools_by_switch[device.switch].append(state)

    def add_pool(self, info: PoolInfo) -> bool:
        """Index a pool that its fabric reports now and the index lacks, with all it has free; returns whether it
        did. Only of a device indexed as carved (in no bucket): a device bound whole until now becomes carved at
        the next build, which takes it out of its bucket."""
        device = self.devices.get(info.device)
        if device is None or device.fabric != info.fabric or info.id in self.pools or info.device in self.bucket_of:
            return False
        self._add_pool(info, device)
        return True

    def unclaimed(self, pool: str) -> bool:
        """Whether no claim holds anything of ``pool``: all its bytes and logical devices free, none beyond."""
        state = self.pools[pool]
        info = state.info
        return (
            state.free_bytes == info.capacity.total_bytes and not state.excess_bytes and state.free_lds == info.ld_count
        )

    def drop_pool(self, pool: str) -> None:
        """Take out of the index a pool that its fabric no longer reports; the caller checks it is `unclaimed`."""
        state = self.pools.pop(pool)
        on_switch = self.pools_by_switch[state.device.switch]
        on_switch[:] = [s for s in on_switch if s is not state]

    def claim_host(self, host: str, owner: str) -> None:
        current = self.host_owner.get(host)
        if current == owner:
            return
        if current is not None:
            raise ValueError(f"host {host} is held by {current}")
        free = self.free_hosts
        at = self._offered_at  # per Compose, where `hosts_from` offered the host: looked at before a search
        if at < len(free) and free[at][2] == host:
            del free[at]
        else:
            h = self.hosts[host]
            at, present = _find(free, (h.cores, h.memory_bytes, h.id))
            if present:
                del free[at]
        self.host_owner[host] = owner

    def release_host(self, host: str) -> None:
        if self.host_owner.pop(host, None) is not None and host in self.hosts:
            h = self.hosts[host]
            at, free = _find(self.free_hosts, (h.cores, h.memory_bytes, h.id))
            if not free:
                self.free_hosts.insert(at, (h.cores, h.memory_bytes, h.id))

    def set_health(self, device: str, health: Health) -> Device | None:
        """Record a device's new health; a device that is not OK leaves the free pool. Returns the old record."""
        old = self.devices.get(device)
        if old is None:
            return None
        self.devices[device] = new = attrs.evolve(old, health=health)
        for state in self.pools_by_switch.get(old.switch, ()):
            if state.device.id == device:
                state.device = new
        if device in self.bucket_of and device not in self.owner:
            was_free = self.is_free(device)
            if health is Health.OK and not was_free:
                self._set_free(device, True)
            elif health is not Health.OK and was_free:
                self._set_free(device, False)
        return old

    def hosts_from(self, min_cores: int, min_memory: int) -> Iterator[Host]:
        """Free hosts with at least ``min_cores``, smallest first (cores, then memory, then id).

        They start where the host offered last was, when that is where a search would find them: per Compose,
        since a Compose claims the host offered, and the next one of the same cores then takes its place. Two
        comparisons cost less than the search's dozen over a rack's hosts."""
        free = self.free_hosts
        first = (min_cores, -1, "")
        start = self._offered_at
        if not (start < len(free) and first <= free[start] and (start == 0 or free[start - 1] < first)):
            start = bisect_left(free, first)
        for at in range(start, len(free)):
            _cores, memory, host_id = free[at]
            if memory >= min_memory:
                self._offered_at = at
                yield self.hosts[host_id]

    def latency(self, host: str, device: Device) -> int | None:
        lat = self.reach_map.get(host, {}).get(device.switch)
        return None if lat is None else lat + device.link_latency_ns
