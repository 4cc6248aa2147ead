"""Placement: an inventory and a request in, a plan or a precise "no fit because ..." out. Pure; no I/O.

Deterministic for a given inventory: buckets hold their free devices sorted, hosts are tried smallest
first, and the policy orders groups by total keys.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs

from disagg.composer.index import Bucket, Inventory
from disagg.errors import InvalidRequestError, NoFitError, UnknownHostError
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.model import (
    Affinity,
    CompositionRequest,
    DeviceKind,
    DevicePick,
    Host,
    HostRequest,
    MemoryPick,
    Plan,
    ResourceRequest,
    Selector,
    format_size,
    selector_refusal,
)


@attrs.frozen
class Pin:
    """Extra constraints on a line when it grows a live composition or replaces a failed device."""

    switch: str | None = None
    used_domains: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()


NO_PIN = Pin()
Line = tuple[int, ResourceRequest, Pin]


def describe_selectors(selectors: Sequence[Selector]) -> str:
    parts = []
    for sel in selectors:
        value = sel.value
        big = isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20
        shown = format_size(value).replace(" ", "") if big and isinstance(value, int) else str(value)
        parts.append(f"{sel.key}{sel.op.value}{shown}")
    return f" ({', '.join(parts)})" if parts else ""


def describe_line(r: ResourceRequest) -> str:
    what = f"{format_size(r.amount_bytes)} of {r.kind.value}" if r.carved else f"{r.count} {r.kind.value}"
    return what + describe_selectors(r.selectors)


def _whole_devices(lines: Sequence[ResourceRequest]) -> dict[DeviceKind, int]:
    """How many whole devices of each kind ``lines`` ask (amounts carved from pools aside)."""
    need: dict[DeviceKind, int] = {}
    for r in lines:
        if not r.carved:
            need[r.kind] = need.get(r.kind, 0) + r.count
    return need


class Placer:
    """Places requests on one inventory snapshot with one policy."""

    def __init__(self, inventory: Inventory, policy: PlacementPolicy) -> None:
        self.inv = inventory
        self.policy = policy
        self._match_cache: dict[tuple[Selector, ...], dict[int, bool]] = {}

    def check(self, request: CompositionRequest) -> None:
        for i, r in enumerate(request.resources):
            if r.carved and (r.spread or r.affinity is Affinity.SAME_SWITCH):
                raise InvalidRequestError(
                    f"resource {i}: spread and same-switch choose among whole devices; an amount of memory is "
                    "carved from pools, nearest first",
                    field=f"resources[{i}]",
                )
            for sel in r.selectors:
                refusal = selector_refusal(sel.key, resource=True)
                if refusal:
                    raise InvalidRequestError(f"resource {i}: {sel}: {refusal}", field=f"resources[{i}].selectors")

    def place(self, request: CompositionRequest, owner: str = "") -> Plan:
        """A plan for the whole request, or `NoFitError` saying which constraint failed and by how much."""
        self.check(request)
        lines = [(i, r, NO_PIN) for i, r in enumerate(request.resources)]
        hr = request.host
        if hr.name:
            host = self.inv.hosts.get(hr.name)
            if host is None:
                raise UnknownHostError(hr.name, f"host {hr.name!r} is not attached to any fabric")
            holder = self.inv.host_owner.get(host.id)
            if holder is not None and holder != owner:
                raise NoFitError(f"host {host.id} already belongs to {holder}")
            short = self._host_shortfall(host, request)
            if short:
                raise NoFitError(f"host {host.id} {short}")
            plan, why = self.try_host(host.id, lines)
            if plan is None:
                raise NoFitError(why)
            return plan
        candidates = 0
        skipped = 0
        first_failure: Callable[[], str] | None = None
        need = _whole_devices(request.resources)
        for host in self._candidates(hr):
            candidates += 1
            if not self._precheck(host.id, need):
                skipped += 1
                continue
            plan, failure = self._attempt(host.id, lines)
            if plan is not None:
                return plan
            first_failure = first_failure or failure
        if candidates == 0:
            raise NoFitError(
                f"no free host has at least {hr.min_cores} cores and {format_size(hr.min_memory_bytes)} of memory"
                f"{describe_selectors(hr.selectors)}: {len(self.inv.free_hosts)} of {len(self.inv.hosts)} hosts "
                "are free"
            )
        detail = f"; first candidate: {first_failure()}" if first_failure is not None else ""
        if first_failure is None and skipped:
            detail = "; " + self._most_reached(hr, need)
        raise NoFitError(
            f"no host can take {', '.join(describe_line(r) for r in request.resources)}: {candidates} candidate "
            f"hosts, {skipped} of them reach too few free devices of a requested kind{detail}"
        )

    def _candidates(self, hr: HostRequest) -> Iterator[Host]:
        """The free hosts with the cores and memory ``hr`` asks, smallest first, that match its selectors."""
        hosts = self.inv.hosts_from(hr.min_cores, hr.min_memory_bytes)
        if not hr.selectors:
            return hosts
        return (h for h in hosts if all(sel.matches(h.attribute(sel.key)) for sel in hr.selectors))

    def _most_reached(self, hr: HostRequest, need: Mapping[DeviceKind, int]) -> str:
        """The numbers behind a refusal that no candidate host got past `_precheck`: per kind of whole devices
        asked, how many the best candidate reaches free. Only on the way to a `NoFitError`."""
        best = dict.fromkeys(need, 0)
        for host in self._candidates(hr):
            free = self.inv.host_free.get(host.id, {})
            for kind in need:
                best[kind] = max(best[kind], free.get(kind, 0))
        parts = [f"{need[k]} {k.value} asked, at most {best[k]} free within one host's reach" for k in need]
        if DeviceKind.CXL_MEMORY in need and not self.inv.by_kind.get(DeviceKind.CXL_MEMORY):
            parts.append("every cxl-memory device here backs a pool: ask for an amount of memory, e.g. 512GiB")
        return "; ".join(parts)

    def _host_shortfall(self, host: Host, request: CompositionRequest) -> str:
        hr = request.host
        if host.cores < hr.min_cores:
            return f"has {host.cores} cores, {hr.min_cores} asked"
        if host.memory_bytes < hr.min_memory_bytes:
            return f"has {format_size(host.memory_bytes)} of memory, {format_size(hr.min_memory_bytes)} asked"
        for sel in hr.selectors:
            if not sel.matches(host.attribute(sel.key)):
                return f"does not match {sel}"
        return ""

    def _precheck(self, host: str, need: Mapping[DeviceKind, int]) -> bool:
        free = self.inv.host_free.get(host, {})
        return all(free.get(kind, 0) >= n for kind, n in need.items())

    def try_host(self, host: str, lines: Sequence[Line]) -> tuple[Plan | None, str]:
        """Place ``lines`` for ``host``; earlier lines' picks are not offered to later ones.

        Returns the plan, or None and the reason it failed.
        """
        plan, failure = self._attempt(host, lines)
        return plan, (failure() if failure is not None else "")

    def _attempt(self, host: str, lines: Sequence[Line]) -> tuple[Plan | None, Callable[[], str] | None]:
        """Like `try_host`, but the reason is left for the caller to compute: explaining scans the fabric."""
        taken: dict[int, int] = {}
        taken_pool: dict[str, int] = {}
        taken_lds: dict[str, int] = {}
        devices: list[DevicePick] = []
        memory: list[MemoryPick] = []
        for idx, r, pin in lines:
            if r.carved:
                carved = self._carve(host, idx, r, pin, taken_pool, taken_lds=taken_lds)
                if carved is None:
                    explain = self._explain_memory
                    return None, functools.partial(explain, host, r, dict(taken_pool), dict(taken_lds))
                memory.extend(carved)
            else:
                picked = self._pick(host, idx, r, pin, taken)
                if picked is None:
                    return None, functools.partial(self._explain_devices, host, r, pin, dict(taken))
                devices.extend(picked)
        return Plan(host, tuple(devices), tuple(memory)), None

    def _matcher(self, selectors: tuple[Selector, ...]) -> Callable[[Bucket], bool]:
        """Whether a bucket matches ``selectors``, remembered per bucket: selectors are hashed once per line."""
        cache = self._match_cache.setdefault(selectors, {})

        def matches(bucket: Bucket) -> bool:
            hit = cache.get(bucket.key)
            if hit is None:
                hit = cache[bucket.key] = all(sel.matches(bucket.exemplar.attribute(sel.key)) for sel in selectors)
            return hit

        return matches

    def _matches(self, bucket: Bucket, selectors: tuple[Selector, ...]) -> bool:
        return self._matcher(selectors)(bucket)

    def _groups(self, host: str, r: ResourceRequest, pin: Pin, taken: Mapping[int, int]) -> list[DeviceGroup]:
        groups = []
        limit = r.max_latency_ns
        matches = self._matcher(r.selectors) if r.selectors else None
        by_switch_kind = self.inv.by_switch_kind
        kind = r.kind
        for lat_sw, sw in self.inv.reach.get(host, ()):
            if limit is not None and lat_sw > limit:
                break
            if pin.switch is not None and sw != pin.switch:
                continue
            for b in by_switch_kind.get((sw, kind), ()):
                free = len(b.free) - taken.get(b.key, 0)
                lat = lat_sw + b.exemplar.link_latency_ns
                if free <= 0 or (limit is not None and lat > limit) or (matches is not None and not matches(b)):
                    continue
                groups.append(DeviceGroup(b.key, sw, lat, free, b.exemplar.failure_domains))
        return groups

    def _pick(
        self, host: str, idx: int, r: ResourceRequest, pin: Pin, taken: dict[int, int]
    ) -> list[DevicePick] | None:
        groups = self._groups(host, r, pin, taken)
        if r.affinity is Affinity.SAME_SWITCH and pin.switch is None:
            switch = self.policy.choose_switch(groups, r.count)
            if switch is None:
                return None
            groups = [g for g in groups if g.switch == switch]
        need = r.count
        used = set(pin.used_domains)
        picks: list[DevicePick] = []
        for g in self.policy.order_groups(groups):
            if need == 0:
                break
            if r.spread:
                value = g.failure_domains.get(r.spread)
                if value is None or value in used:
                    continue
                used.add(value)
                k = 1
            else:
                k = min(g.free, need)
            bucket = self.inv.buckets[g.key]
            start = taken.get(g.key, 0)
            if pin.exclude:
                chosen = [d for d in bucket.free[start : start + k + len(pin.exclude)] if d not in pin.exclude][:k]
            else:
                chosen = bucket.free[start : start + k]
            if len(chosen) < k:
                continue
            taken[g.key] = start + k
            for d in chosen:
                picks.append(DevicePick(d, idx, g.latency_ns))
            need -= k
        if need:
            for p in picks:
                taken[self.inv.bucket_of[p.device].key] -= 1
            return None
        return picks

    def _pool_candidates(
        self, host: str, r: ResourceRequest, taken: Mapping[str, int], taken_lds: Mapping[str, int]
    ) -> list[PoolCandidate]:
        """The pools ``host`` reaches that can take one more allocation for ``r``: with bytes free beyond
        ``taken`` and, for an MLD, a logical device free beyond ``taken_lds`` (the plan's earlier picks); none
        whose device is unhealthy or cordoned (a cordon of a pool's device is how an operator drains the pool)."""
        out = []
        limit = r.max_latency_ns
        for lat_sw, sw in self.inv.reach.get(host, ()):
            if limit is not None and lat_sw > limit:
                break
            for ps in self.inv.pools_by_switch.get(sw, ()):
                lat = lat_sw + ps.device.link_latency_ns
                free = ps.free_bytes - taken.get(ps.info.id, 0)
                if free <= 0 or (limit is not None and lat > limit) or ps.device.health.value != "OK":
                    continue
                if ps.device.id in self.inv.cordoned:
                    continue
                if ps.free_lds is not None and ps.free_lds - taken_lds.get(ps.info.id, 0) <= 0:
                    continue
                if not all(sel.matches(ps.device.attribute(sel.key)) for sel in r.selectors):
                    continue
                out.append(PoolCandidate(ps.info.id, sw, lat, free))
        return out

    def _carve(
        self, host: str, idx: int, r: ResourceRequest, pin: Pin, taken: dict[str, int], *, taken_lds: dict[str, int]
    ) -> list[MemoryPick] | None:
        """Carve ``r`` as one allocation per pool; ``taken`` and ``taken_lds`` gain the bytes and MLD logical
        devices the picks use, so that later lines of the plan do not count on them."""
        pools = [p for p in self._pool_candidates(host, r, taken, taken_lds) if p.pool not in pin.exclude]
        remaining = r.amount_bytes
        picks: list[MemoryPick] = []
        mlds: list[str] = []
        for cand in self.policy.order_pools(pools, r.amount_bytes):
            if remaining <= 0:
                break
            state = self.inv.pools[cand.pool]
            cap = state.info.capacity
            usable = cand.free_bytes // cap.block_bytes * cap.block_bytes
            take = min(usable, cap.round_up(remaining))
            if take <= 0:
                continue
            picks.append(MemoryPick(cand.pool, take, idx, cand.latency_ns))
            if state.free_lds is not None:
                mlds.append(cand.pool)
            remaining -= take
        if remaining > 0:
            return None
        for p in picks:
            taken[p.pool] = taken.get(p.pool, 0) + p.amount_bytes
        for pool in mlds:
            taken_lds[pool] = taken_lds.get(pool, 0) + 1
        return picks

    def _explain_devices(self, host: str, r: ResourceRequest, pin: Pin, taken: Mapping[int, int]) -> str:
        def free(b: Bucket) -> int:
            return max(0, len(b.free) - taken.get(b.key, 0))

        matching = [b for b in self.inv.by_kind.get(r.kind, ()) if self._matches(b, r.selectors)]
        total = sum(free(b) for b in matching)
        reach = self.inv.reach_map.get(host, {})
        reachable = [b for b in matching if b.switch in reach]
        limit = r.max_latency_ns
        within = [b for b in reachable if limit is None or reach[b.switch] + b.link_latency_ns <= limit]
        where = f" within {limit} ns" if limit is not None else ""
        text = (
            f"{describe_line(r)}{where} of host {host} asked: {total} free, "
            f"{sum(free(b) for b in reachable)} of them reachable from {host}"
        )
        if limit is not None:
            text += f", {sum(free(b) for b in within)} within {limit} ns"
        if pin.switch is not None:
            text += f", {sum(free(b) for b in within if b.switch == pin.switch)} on switch {pin.switch}"
        elif r.affinity is Affinity.SAME_SWITCH:
            per_switch: dict[str, int] = {}
            for b in within:
                per_switch[b.switch] = per_switch.get(b.switch, 0) + free(b)
            text += f", at most {max(per_switch.values(), default=0)} on one switch"
        if r.spread:
            values = {b.failure_domains.get(r.spread) for b in within if free(b) > 0} - {None} - set(pin.used_domains)
            text += f", in {len(values)} distinct {r.spread} domains"
        return text

    def _explain_memory(
        self, host: str, r: ResourceRequest, taken: Mapping[str, int], taken_lds: Mapping[str, int]
    ) -> str:
        reach = self.inv.reach_map.get(host, {})
        total = reachable = within = no_ld = cordoned = 0
        limit = r.max_latency_ns
        for ps in self.inv.pools.values():
            free = max(0, ps.free_bytes - taken.get(ps.info.id, 0))
            total += free
            sw_lat = reach.get(ps.device.switch)
            if sw_lat is None:
                continue
            reachable += free
            if ps.device.id in self.inv.cordoned:
                cordoned += free
            elif ps.free_lds is not None and ps.free_lds - taken_lds.get(ps.info.id, 0) <= 0:
                no_ld += free
            if limit is None or sw_lat + ps.device.link_latency_ns <= limit:
                within += free
        where = f" within {limit} ns" if limit is not None else ""
        text = (
            f"{describe_line(r)}{where} of host {host} asked: {format_size(total)} free, "
            f"{format_size(reachable)} of it reachable from {host}"
        )
        if limit is not None:
            text += f", {format_size(within)} within {limit} ns"
        if no_ld:
            text += f"; {format_size(no_ld)} of the reachable is in MLD pools with no logical device free"
        if cordoned:
            text += f"; {format_size(cordoned)} of the reachable is in pools whose device is cordoned"
        return text
