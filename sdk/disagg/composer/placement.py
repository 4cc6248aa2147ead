"""Placement: an inventory and a request in, a plan or a precise "no fit because ..." out. Pure: no I/O but the
log of a placement policy's unexpected exception.

Deterministic for a given inventory: buckets hold their free devices sorted, hosts are tried smallest
first, and the policy orders groups by total keys.

A host is tried greedily first: each line in turn takes what the policy prefers. That pass is the common case
and stays cheap. When it fails on a line that shares what it needs with other lines of the request (devices of
its kind, or memory pools), the host is searched (`_Search`): the lines most constrained first, backtracking
over the groups and pools each may take, within `SEARCH_STEPS` choices a host and `REQUEST_SEARCH_STEPS` a
request. So a request is refused only when no arrangement of its lines fits any host (or a bound stopped the
search, which the refusal says), and the smallest host that fits is the one chosen.

A policy is a plugin: what it answers is checked. A group, switch or pool it was not offered, or an exception
it raises, is refused with `PluginError` naming it; nothing was claimed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import attrs

from disagg.composer.index import Bucket, Inventory, PoolState
from disagg.errors import DisaggError, InvalidRequestError, NoFitError, PluginError, UnknownHostError
from disagg.incidents import described, log_incident
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.model import (
    Affinity,
    CompositionRequest,
    DeviceKind,
    DevicePick,
    Health,
    Host,
    HostRequest,
    MemoryPick,
    Plan,
    ResourceRequest,
    Selector,
    format_size,
    selector_refusal,
)

log = logging.getLogger("disagg.composer")

SEARCH_STEPS = 500
"""The most choices (a line's groups and counts, or pools and amounts) the search tries on one host after the
greedy pass failed there: enough to settle a request of a few lines on a rack-sized domain."""
REQUEST_SEARCH_STEPS = 2_000
"""The most choices the search tries for one request over all the hosts it tries, so that a request no host can
take costs a few milliseconds more than the greedy passes, however large the fabric. Hosts that reach what a
host that failed reaches are not tried again."""


@attrs.define
class _Budget:
    """What the search may still do for one request: ``left`` choices; ``unsearched``, the hosts the greedy
    pass missed on once none were left."""

    left: int
    unsearched: int = 0


@attrs.frozen
class Pin:
    """Extra constraints on a line when it grows a live composition or replaces a failed device."""

    switch: str | None = None
    used_domains: frozenset[str] = frozenset()


NO_PIN = Pin()
Line = tuple[int, ResourceRequest, Pin]
DeviceChoice = tuple[tuple[DeviceGroup, int], ...]
"""What one line takes: so many devices of each group."""
MemoryChoice = tuple[tuple[PoolCandidate, int], ...]
"""What one line carves: so many bytes of each pool."""
Offered = TypeVar("Offered", DeviceGroup, PoolCandidate)


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


def _family(r: ResourceRequest) -> tuple[DeviceKind, bool]:
    """Lines of one family draw on the same devices (one kind) or the same pools; other families never meet."""
    return r.kind, r.carved


LineNames = Callable[[Sequence[int]], str]
"""How a refusal names some lines of a request, given their indices (`Line`'s first item)."""


def _line_name(field: str, i: int) -> str:
    """How a refusal of `Placer.check_lines` names line ``i`` of the request's ``field``: spelt out only for a
    refusal, not for every line checked."""
    return f"resource {i}" if field == "resources" else f"{field}[{i}]"


def _listed(names: Sequence[str]) -> str:
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


def request_lines(lines: Sequence[int]) -> str:
    """Lines of a Compose request, by their place among its resources: "lines 0 and 2 of this request"."""
    return f"line{'s' if len(lines) > 1 else ''} {_listed([str(i) for i in lines])} of this request"


def added_lines(first: int) -> LineNames:
    """Lines of a recompose's ``add``, placed as the composition's lines ``first`` on, as the request names
    them: "add[0] and add[1]". Numbered as the composition's, they would name lines the request does not have."""
    return lambda lines: _listed([f"add[{i - first}]" for i in lines])


def _held_by(held: Mapping[int, int], shown: Callable[[int], str], pronoun: str, named: LineNames) -> str:
    """``held``: per line of the request, how much of what a failed line could use it holds."""
    lines = [i for i, n in held.items() if n]
    if not lines:
        return ""
    return f", {shown(sum(held.values()))} of {pronoun} held by {named(lines)}"


@attrs.frozen
class _Miss:
    """Where a greedy pass failed: the failing line's position among the lines, and the reason, computed only
    when asked (explaining scans the fabric), with the lines named as the request names them."""

    at: int
    explain: Callable[[LineNames], str]


def _noted(explain: Callable[[LineNames], str], note: str, named: LineNames) -> str:
    return explain(named) + note


MATCH_CACHE_SELECTORS = 4_096
"""How many distinct selector tuples a placer remembers the matching buckets of (`Placer._matcher`)."""


class Placer:
    """Places requests on one inventory snapshot with one policy."""

    def __init__(self, inventory: Inventory, policy: PlacementPolicy) -> None:
        self.inv = inventory
        self.policy = policy
        self._match_cache: dict[tuple[Selector, ...], dict[int, bool]] = {}
        self._last_group: dict[int, DeviceGroup] = {}
        """Per bucket, the group `_groups` last made of it, offered again while its free count and latency are
        the same: one a bucket, so that most groups of a Compose are not made anew."""

    def check_lines(self, resources: Sequence[ResourceRequest], field: str = "resources") -> None:
        """Refuse lines no placement can honour, named as the request's ``field`` names them: ``resource 1`` of
        a Compose, ``add[1]`` of a recompose."""
        for i, r in enumerate(resources):
            if (r.spread or r.affinity is Affinity.SAME_SWITCH) and r.carved:
                raise InvalidRequestError(
                    f"{_line_name(field, i)}: spread and same-switch choose among whole devices; an amount of "
                    "memory is carved from pools, nearest first",
                    field=f"{field}[{i}]",
                )
            for sel in r.selectors:
                refusal = selector_refusal(sel.key, resource=True)
                if refusal:
                    raise InvalidRequestError(
                        f"{_line_name(field, i)}: {sel}: {refusal}", field=f"{field}[{i}].selectors"
                    )

    def place(self, request: CompositionRequest, owner: str = "") -> Plan:
        """A plan for the whole request, or `NoFitError` saying which constraint failed and by how much."""
        self.check_lines(request.resources)
        lines: list[Line] = []
        need: dict[DeviceKind, int] = {}  # the whole devices of each kind asked (amounts carved from pools aside)
        for i, r in enumerate(request.resources):
            lines.append((i, r, NO_PIN))
            if not r.amount_bytes:  # `r.carved` without its call: per line of a Compose
                need[r.kind] = need.get(r.kind, 0) + r.count
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
        first_failure: Callable[[LineNames], str] | None = None
        failed: set[tuple[tuple[int, str], ...]] = set()
        budget: _Budget | None = None  # made at the first miss: most requests fit the first host greedily
        for host in self._candidates(hr):
            candidates += 1
            if not self._precheck(host.id, need):
                skipped += 1
                continue
            # What a host reaches, and at which latencies, decides whether the request fits it: a host of the
            # same domain as one that failed fails too, and is not tried (nor searched) again.
            if failed and tuple(self.inv.reach.get(host.id, ())) in failed:
                continue
            attempt = self._attempt(host.id, lines)
            if isinstance(attempt, Plan):
                return attempt
            budget = budget or _Budget(REQUEST_SEARCH_STEPS)
            plan, failure = self._search_after(host.id, lines, attempt, budget)
            if plan is not None:
                return plan
            failed.add(tuple(self.inv.reach.get(host.id, ())))
            first_failure = first_failure or failure
        if candidates == 0:
            raise NoFitError(
                f"no free host has at least {hr.min_cores} cores and {format_size(hr.min_memory_bytes)} of memory"
                f"{describe_selectors(hr.selectors)}: {len(self.inv.free_hosts)} of {len(self.inv.hosts)} hosts "
                "are free"
            )
        detail = f"; first candidate: {first_failure(request_lines)}" if first_failure is not None else ""
        if first_failure is None and skipped:
            detail = "; " + self._most_reached(hr, need)
        if budget is not None and budget.unsearched:
            n = budget.unsearched
            detail += (
                f"; {n} more candidate{'' if n == 1 else 's'} tried greedily only: the search's bound of "
                f"{REQUEST_SEARCH_STEPS} choices for a request was spent"
            )
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
        """Whether ``host`` reaches enough free devices of each kind ``need`` asks: per candidate host, so a
        plain loop, which makes no generator."""
        free = self.inv.host_free.get(host, {})
        for kind, n in need.items():  # noqa: SIM110 (all() over a generator costs one per candidate host)
            if free.get(kind, 0) < n:
                return False
        return True

    def try_host(self, host: str, lines: Sequence[Line], named: LineNames = request_lines) -> tuple[Plan | None, str]:
        """Place ``lines`` for ``host``; no device or pool bytes serve two lines.

        Returns the plan, or None and the reason it failed, which names lines as ``named`` does.
        """
        attempt = self._attempt(host, lines)
        if isinstance(attempt, Plan):
            return attempt, ""
        plan, failure = self._search_after(host, lines, attempt, _Budget(REQUEST_SEARCH_STEPS))
        return plan, (failure(named) if plan is None else "")

    def _search_after(
        self, host: str, lines: Sequence[Line], miss: _Miss, budget: _Budget
    ) -> tuple[Plan | None, Callable[[LineNames], str]]:
        """After the greedy pass missed, the search, if the line it missed on shares its family with other
        lines. The reason is left for the caller to compute: explaining scans the fabric."""
        family = _family(lines[miss.at][1])
        if sum(1 for _, r, _ in lines if _family(r) == family) < 2:
            return None, miss.explain
        if not budget.left:
            budget.unsearched += 1
            return None, miss.explain
        search = _Search(self, host, budget, miss)
        plan = search.place(lines)
        if plan is not None:
            return plan, miss.explain
        return None, functools.partial(_noted, search.miss.explain, search.verdict())

    def _attempt(self, host: str, lines: Sequence[Line]) -> Plan | _Miss:
        """The greedy pass: each line in turn takes what the policy prefers among what earlier lines left."""
        taken: dict[int, int] = {}
        taken_pool: dict[str, int] = {}
        taken_lds: dict[str, int] = {}
        devices: list[DevicePick] = []
        memory: list[MemoryPick] = []
        for idx, r, pin in lines:
            if r.amount_bytes:  # `r.carved` without its call: per line of a Compose
                carved = self._carve(host, idx, r, taken_pool, taken_lds)
                if carved is None:
                    explain = functools.partial(self._explain_memory, host, r, tuple(memory))
                    return _Miss(lines.index((idx, r, pin)), explain)
                memory.extend(carved)
            else:
                groups = self._groups(host, r, pin, taken)
                if r.affinity is Affinity.SAME_SWITCH and pin.switch is None:
                    picked = self._pick_on_one_switch(idx, r, pin, groups, taken)
                else:
                    picked = self._pick(idx, r, pin, groups, taken)
                if picked is None:
                    explain = functools.partial(self._explain_devices, host, r, pin, tuple(devices))
                    return _Miss(lines.index((idx, r, pin)), explain)
                devices.extend(picked)
        return Plan(host, tuple(devices), tuple(memory))

    # -- asking the policy ---------------------------------------------------------------------------------------

    def _refuse(self, method: str, exc: Exception) -> PluginError:
        """The error for a policy that raised: its text goes to the log only, under an incident id."""
        name = self.policy.name or type(self.policy).__name__
        incident = log_incident(log, exc, f"placement policy {name!r} raised {described(exc)} in {method}")
        return PluginError(
            f"placement policy {name!r} failed in {method} ({type(exc).__name__}); incident {incident} in the "
            "fabric manager's log; nothing was placed",
            metadata={"policy": name, "incident": incident},
        )

    def _not_offered(self, method: str, answer: object) -> PluginError:
        name = self.policy.name or type(self.policy).__name__
        return PluginError(
            f"placement policy {name!r} answered {method} with {answer!r}, which it was not offered; nothing was "
            "placed",
            metadata={"policy": name},
        )

    def _offered(self, method: str, answer: object, offered: Sequence[Offered]) -> Offered:
        """The offered candidate that the policy's ``answer`` is: the very object, or one equal to it. Ours is
        used from then on, so that a policy cannot change a group's free count or latency."""
        for o in offered:
            if o is answer:
                return o
        for o in offered:
            if o == answer:
                return o
        raise self._not_offered(method, answer)

    def _ordered_groups(self, groups: Sequence[DeviceGroup]) -> list[DeviceGroup]:
        """The policy's order of ``groups``, every one checked and none twice: for the search, which takes
        from any of them. (`_pick` asks the same way, inline.)"""
        try:
            answers = tuple(self.policy.order_groups(groups))
        except DisaggError:
            raise
        except Exception as exc:
            raise self._refuse("order_groups", exc) from exc
        ordered: dict[int, DeviceGroup] = {}
        for answer in answers:
            g = self._offered("order_groups", answer, groups)
            ordered.setdefault(g.key, g)
        return list(ordered.values())

    def _choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        try:
            switch = self.policy.choose_switch(groups, need)
        except DisaggError:
            raise
        except Exception as exc:
            raise self._refuse("choose_switch", exc) from exc
        if switch is not None and not any(g.switch == switch for g in groups):
            raise self._not_offered("choose_switch", switch)
        return switch

    def _order_pools(self, pools: Sequence[PoolCandidate], amount: int) -> Sequence[PoolCandidate]:
        """The policy's order of ``pools``, as it answered: each pool is checked by `_offered` when used."""
        try:
            ordered = self.policy.order_pools(pools, amount)
            # A list or tuple is read as it is; anything else is read here, where what it raises is the policy's.
            return ordered if type(ordered) is list or type(ordered) is tuple else tuple(ordered)
        except DisaggError:
            raise
        except Exception as exc:
            raise self._refuse("order_pools", exc) from exc

    def _ordered_pools(self, pools: Sequence[PoolCandidate], amount: int) -> list[PoolCandidate]:
        """The policy's order of ``pools``, every one checked and none twice: for the search."""
        ordered: dict[str, PoolCandidate] = {}
        for answer in self._order_pools(pools, amount):
            p = self._offered("order_pools", answer, pools)
            ordered.setdefault(p.pool, p)
        return list(ordered.values())

    # -- devices -------------------------------------------------------------------------------------------------

    def _matcher(self, selectors: tuple[Selector, ...]) -> Callable[[Bucket], bool]:
        """Whether a bucket matches ``selectors``, remembered per bucket: selectors are hashed once per line. At
        most `MATCH_CACHE_SELECTORS` selector tuples are remembered, then all are forgotten at once: one placer
        serves a healthy fabric for months, and a scheduler that asks ``gpu_memory >= N`` for each job's N (or
        previews them) made a new tuple each time, so memory grew without end; forgetting costs only matching
        again."""
        cache = self._match_cache.get(selectors)
        if cache is None:
            if len(self._match_cache) >= MATCH_CACHE_SELECTORS:
                self._match_cache.clear()
            cache = self._match_cache[selectors] = {}

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
        last = self._last_group
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
                g = last.get(b.key)
                if g is None or g.free != free or g.latency_ns != lat:
                    g = last[b.key] = DeviceGroup(b.key, sw, lat, free, b.exemplar.failure_domains)
                groups.append(g)
        return groups

    def _switches(self, groups: Sequence[DeviceGroup], r: ResourceRequest, pin: Pin) -> Iterator[str]:
        """The switches a same-switch line may take from, in the policy's order: it is asked again, without the
        switch it chose, when that one cannot serve the line. Under spread only switches with enough distinct
        domains are offered, since a switch with enough free devices may have them all in one domain."""
        if r.spread:
            groups = _spread_enough(groups, r.spread, pin.used_domains, r.count)
        while groups:
            switch = self._choose_switch(groups, r.count)
            if switch is None:
                return
            yield switch
            groups = [g for g in groups if g.switch != switch]

    def _pick_on_one_switch(
        self, idx: int, r: ResourceRequest, pin: Pin, groups: Sequence[DeviceGroup], taken: dict[int, int]
    ) -> list[DevicePick] | None:
        for switch in self._switches(groups, r, pin):
            picks = self._pick(idx, r, pin, [g for g in groups if g.switch == switch], taken)
            if picks is not None:
                return picks
        return None

    def _pick(
        self, idx: int, r: ResourceRequest, pin: Pin, groups: Sequence[DeviceGroup], taken: dict[int, int]
    ) -> list[DevicePick] | None:
        """Drain ``groups`` in the policy's order for ``r``; ``taken`` gains the picks, or is left as it was.
        The policy is asked and its answers checked inline (as `_ordered_groups` and `_offered` do): this is
        the hot path."""
        need = r.count
        used = pin.used_domains  # grows, as a new set, only under spread
        picks: list[DevicePick] = []
        try:
            ordered = self.policy.order_groups(groups)
            # A list or tuple is read as it is; anything else is read here, where what it raises is the policy's.
            if type(ordered) is not list and type(ordered) is not tuple:
                ordered = tuple(ordered)
        except DisaggError:
            raise
        except Exception as exc:
            raise self._refuse("order_groups", exc) from exc
        for answer in ordered:
            if need == 0:
                break
            for g in groups:  # `_offered`, inline for the common case
                if g is answer:
                    break
            else:
                g = self._offered("order_groups", answer, groups)
            start = taken.get(g.key, 0)
            if r.spread:
                value = g.failure_domains.get(r.spread)
                if value is None or value in used:
                    continue
                k = 1
            else:
                k = min(g.free, need)
            chosen = self.inv.buckets[g.key].free[start : start + k]
            if len(chosen) < k:  # the policy listed this group twice
                continue
            if r.spread:
                used = used | {g.failure_domains[r.spread]}
            taken[g.key] = start + k
            for d in chosen:
                picks.append(DevicePick(d, idx, g.latency_ns))
            need -= k
        if need:
            for p in picks:
                taken[self.inv.bucket_of[p.device].key] -= 1
            return None
        return picks

    # -- memory --------------------------------------------------------------------------------------------------

    def _pool_refusal(self, ps: PoolState, lds_taken: int) -> str:
        """Why ``ps`` can take no allocation whatever its free bytes: an unhealthy or cordoned device (a cordon of
        a pool's device is how an operator drains the pool), or an MLD with no logical device free beyond
        ``lds_taken``; "" if it can."""
        if ps.device.health is not Health.OK:
            return f"pools whose device is {ps.device.health.value.lower()}"
        if ps.device.id in self.inv.cordoned:
            return "pools whose device is cordoned"
        if ps.free_lds is not None and ps.free_lds - lds_taken <= 0:
            return "MLD pools with no logical device free"
        return ""

    def _pool_candidates(
        self, host: str, r: ResourceRequest, taken: Mapping[str, int], taken_lds: Mapping[str, int]
    ) -> list[PoolCandidate]:
        """The pools ``host`` reaches that can take one more allocation for ``r``: with bytes free beyond
        ``taken``, matching its selectors, and not refused by `_pool_refusal` (``taken_lds``: the logical
        devices the plan's earlier picks use)."""
        out = []
        limit = r.max_latency_ns
        for lat_sw, sw in self.inv.reach.get(host, ()):
            if limit is not None and lat_sw > limit:
                break
            for ps in self.inv.pools_by_switch.get(sw, ()):
                lat = lat_sw + ps.device.link_latency_ns
                free = ps.free_bytes - taken.get(ps.info.id, 0)
                if free <= 0 or (limit is not None and lat > limit):
                    continue
                if self._pool_refusal(ps, taken_lds.get(ps.info.id, 0)):
                    continue
                if not all(sel.matches(ps.device.attribute(sel.key)) for sel in r.selectors):
                    continue
                out.append(PoolCandidate(ps.info.id, sw, lat, free))
        return out

    def _carve(
        self, host: str, idx: int, r: ResourceRequest, taken: dict[str, int], taken_lds: dict[str, int]
    ) -> list[MemoryPick] | None:
        """Carve ``r`` as one allocation per pool; ``taken`` and ``taken_lds`` gain the bytes and MLD logical
        devices the picks use, so that later lines of the plan do not count on them."""
        pools = self._pool_candidates(host, r, taken, taken_lds)
        remaining = r.amount_bytes
        picks: list[MemoryPick] = []
        for answer in self._order_pools(pools, r.amount_bytes):
            if remaining <= 0:
                break
            cand = self._offered("order_pools", answer, pools)
            if picks and any(p.pool == cand.pool for p in picks):  # one allocation per pool and line
                continue
            cap = self.inv.pools[cand.pool].info.capacity
            usable = cand.free_bytes // cap.block_bytes * cap.block_bytes
            take = min(usable, cap.round_up(remaining))
            if take <= 0:
                continue
            picks.append(MemoryPick(cand.pool, take, idx, cand.latency_ns))
            remaining -= take
        if remaining > 0:
            return None
        for p in picks:
            taken[p.pool] = taken.get(p.pool, 0) + p.amount_bytes
            if self.inv.pools[p.pool].free_lds is not None:
                taken_lds[p.pool] = taken_lds.get(p.pool, 0) + 1
        return picks

    # -- refusals ------------------------------------------------------------------------------------------------

    def _explain_devices(
        self, host: str, r: ResourceRequest, pin: Pin, held: Sequence[DevicePick], named: LineNames
    ) -> str:
        """The numbers behind a line that found too few devices: how many match it, how many of those the host
        reaches, within the latency bound, on the pinned switch; how many of those the request's earlier lines
        (``held``) hold; and, of the rest, how many one switch or how many distinct domains give."""
        matching = [b for b in self.inv.by_kind.get(r.kind, ()) if self._matches(b, r.selectors)]
        reach = self.inv.reach_map.get(host, {})
        reachable = [b for b in matching if b.switch in reach]
        limit = r.max_latency_ns
        within = [b for b in reachable if limit is None or reach[b.switch] + b.link_latency_ns <= limit]
        where = f" within {limit} ns" if limit is not None else ""
        text = (
            f"{describe_line(r)}{where} of host {host} asked: {sum(len(b.free) for b in matching)} free, "
            f"{sum(len(b.free) for b in reachable)} of them reachable from {host}"
        )
        if limit is not None:
            text += f", {sum(len(b.free) for b in within)} within {limit} ns"
        if pin.switch is not None:
            within = [b for b in within if b.switch == pin.switch]
            text += f", {sum(len(b.free) for b in within)} on switch {pin.switch}"
        usable = {b.key for b in within}
        by_line: dict[int, int] = {}
        taken: dict[int, int] = {}
        for p in held:
            key = self.inv.bucket_of[p.device].key
            if key in usable:
                by_line[p.resource] = by_line.get(p.resource, 0) + 1
                taken[key] = taken.get(key, 0) + 1
        text += _held_by(by_line, str, "them", named)

        def left(b: Bucket) -> int:
            return len(b.free) - taken.get(b.key, 0)

        if pin.switch is None and r.affinity is Affinity.SAME_SWITCH:
            per_switch: dict[str, int] = {}
            for b in within:
                per_switch[b.switch] = per_switch.get(b.switch, 0) + left(b)
            text += f", at most {max(per_switch.values(), default=0)} on one switch"
        if r.spread:
            values = {b.failure_domains.get(r.spread) for b in within if left(b) > 0} - {None} - set(pin.used_domains)
            text += f", in {len(values)} distinct {r.spread} domains"
        return text

    def _explain_memory(self, host: str, r: ResourceRequest, held: Sequence[MemoryPick], named: LineNames) -> str:
        """The numbers behind a memory line that could not be carved, counting only the pools that match its
        selectors: their free bytes, those the host reaches, within the latency bound; how much of what could
        serve it the request's earlier lines (``held``) hold; and how much of the reachable cannot serve any
        line, and why (`_pool_refusal`)."""
        reach = self.inv.reach_map.get(host, {})
        lds_held: dict[str, int] = {}
        for p in held:
            lds_held[p.pool] = lds_held.get(p.pool, 0) + 1
        total = reachable = within = 0
        refused: dict[str, int] = {}
        usable: set[str] = set()
        limit = r.max_latency_ns
        for ps in self.inv.pools.values():
            if not all(sel.matches(ps.device.attribute(sel.key)) for sel in r.selectors):
                continue
            total += ps.free_bytes
            sw_lat = reach.get(ps.device.switch)
            if sw_lat is None:
                continue
            reachable += ps.free_bytes
            why = self._pool_refusal(ps, lds_held.get(ps.info.id, 0))
            if why:
                refused[why] = refused.get(why, 0) + ps.free_bytes
            if limit is None or sw_lat + ps.device.link_latency_ns <= limit:
                within += ps.free_bytes
                if not why:
                    usable.add(ps.info.id)
        where = f" within {limit} ns" if limit is not None else ""
        text = (
            f"{describe_line(r)}{where} of host {host} asked: {format_size(total)} free, "
            f"{format_size(reachable)} of it reachable from {host}"
        )
        if limit is not None:
            text += f", {format_size(within)} within {limit} ns"
        by_line: dict[int, int] = {}
        for p in held:
            if p.pool in usable:
                by_line[p.resource] = by_line.get(p.resource, 0) + p.amount_bytes
        text += _held_by(by_line, format_size, "it", named)
        for why, amount in refused.items():
            text += f"; {format_size(amount)} of the reachable is in {why}"
        return text


def _spread_enough(groups: Sequence[DeviceGroup], label: str, used: frozenset[str], need: int) -> list[DeviceGroup]:
    """The groups on switches whose devices span at least ``need`` values of ``label`` beyond ``used``."""
    values: dict[str, set[str]] = {}
    for g in groups:
        value = g.failure_domains.get(label)
        if value is not None and value not in used:
            values.setdefault(g.switch, set()).add(value)
    return [g for g in groups if len(values.get(g.switch, ())) >= need]


def _splits(
    groups: Sequence[DeviceGroup], need: int, spread: str | None, used: frozenset[str]
) -> Iterator[DeviceChoice]:
    """Every way to take ``need`` devices from ``groups``, in their order and most from the first first, as the
    greedy pass takes them; under spread one device per value of the label, none from a group without it or
    with a value in ``used``."""
    room = [0] * (len(groups) + 1)
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        room[i] = room[i + 1] + (int(spread in g.failure_domains) if spread else g.free)

    def walk(i: int, need: int, used: frozenset[str]) -> Iterator[DeviceChoice]:
        if need == 0:
            yield ()
            return
        if room[i] < need:
            return
        g = groups[i]
        if spread:
            value = g.failure_domains.get(spread)
            if value is not None and value not in used:
                for tail in walk(i + 1, need - 1, used | {value}):
                    yield ((g, 1), *tail)
            yield from walk(i + 1, need, used)
            return
        for k in range(min(g.free, need), max(0, need - room[i + 1]) - 1, -1):
            for tail in walk(i + 1, need - k, used):
                yield ((g, k), *tail) if k else tail

    return walk(0, need, used)


def _portions(pools: Sequence[PoolCandidate], blocks: Sequence[int], amount: int) -> Iterator[MemoryChoice]:
    """Every way to carve ``amount`` bytes from ``pools`` (whose blocks are ``blocks`` bytes) in whole blocks and
    no block more than needed, in their order and most from the first first, as the greedy pass carves."""
    usable = [p.free_bytes // b * b for p, b in zip(pools, blocks, strict=True)]
    room = [0] * (len(pools) + 1)
    for i in range(len(pools) - 1, -1, -1):
        room[i] = room[i + 1] + usable[i]

    def walk(i: int, remaining: int) -> Iterator[MemoryChoice]:
        if remaining <= 0:
            yield ()
            return
        if room[i] < remaining:
            return
        block = blocks[i]
        most = min(usable[i], -(-remaining // block) * block)
        least = -(-max(0, remaining - room[i + 1]) // block) * block
        for share in range(most, least - 1, -block):
            for tail in walk(i + 1, remaining - share):
                yield ((pools[i], share), *tail) if share else tail

    return walk(0, amount)


class _Search:
    """Bounded backtracking for one host, after the greedy pass failed there. Families of lines (`_family`)
    never meet, so each is placed on its own: greedily first; then, unless a line fails even alone, depth first
    over the lines most constrained first (least room to spare), each trying every choice (`_splits`,
    `_portions`) in the policy's order, and remembering the states that failed. Stops at `SEARCH_STEPS` choices,
    or when the request's ``budget`` is spent."""

    def __init__(self, placer: Placer, host: str, budget: _Budget, miss: _Miss) -> None:
        self.placer = placer
        self.host = host
        self.budget = budget
        self.miss = miss
        """Where the greedy pass missed: at first on all the lines, then on the family that fits no way."""
        self.steps = 0
        self.cut = False
        """Whether the search stopped at a bound with choices left untried."""
        self.searched = False
        """Whether the family that fits no way was searched beyond the greedy pass and its lines alone: a
        refusal of the greedy pass or of a line alone needs no word on the search."""
        self.failed: set[tuple[object, ...]] = set()
        self.devices: dict[int, int] = {}
        self.pool_bytes: dict[str, int] = {}
        self.pool_lds: dict[str, int] = {}

    def verdict(self) -> str:
        """What a refusal adds after a search that found nothing."""
        if self.cut:
            tried = f"{self.steps} choice{'' if self.steps == 1 else 's'}"
            return f"; the search for another arrangement of the request's lines stopped at its bound, after {tried}"
        return "; no other arrangement of the request's lines fits" if self.searched else ""

    def place(self, lines: Sequence[Line]) -> Plan | None:
        """A plan for ``lines`` on the host, its picks in the order of the lines, or None. The family the greedy
        pass missed on goes first: the others may well fit as the greedy pass placed them."""
        failing = _family(lines[self.miss.at][1])
        families: dict[tuple[DeviceKind, bool], list[Line]] = {failing: []}
        for line in lines:
            families.setdefault(_family(line[1]), []).append(line)
        devices: list[DevicePick] = []
        memory: list[MemoryPick] = []
        for family, members in families.items():
            plan = self._place_family(members, self.miss if family == failing else None)
            if plan is None:
                return None
            devices.extend(plan.devices)
            memory.extend(plan.memory)
        at = {idx: n for n, (idx, _, _) in enumerate(lines)}
        devices.sort(key=lambda p: at[p.resource])
        memory.sort(key=lambda p: at[p.resource])
        return Plan(self.host, tuple(devices), tuple(memory))

    def _place_family(self, lines: Sequence[Line], miss: _Miss | None) -> Plan | None:
        """``miss``: where the greedy pass missed on these lines, if it was tried already."""
        placer = self.placer
        self.searched = False
        if miss is None:
            attempt = placer._attempt(self.host, lines)
            if isinstance(attempt, Plan):
                return attempt
            miss = attempt
        self.miss = miss
        if len(lines) < 2:
            return None
        supply: dict[object, int] = {}
        room = {line[0]: self._room(line, supply) for line in lines}
        distinct = {line[1:]: line for line in lines}.values()  # the same line twice needs checking once
        if min(room.values()) < 0 or not all(self._fits_alone(line) for line in distinct):
            return None  # a line that fits no way alone: its refusal says why
        self.searched = True
        if sum(supply.values()) < sum(r.amount_bytes if r.carved else r.count for _, r, _ in lines):
            return None  # the lines ask more than all they could take together
        self.failed.clear()
        self.devices.clear()
        self.pool_bytes.clear()
        self.pool_lds.clear()
        order = sorted(lines, key=lambda line: room[line[0]])
        choices = self._descend(order, 0)
        return None if choices is None else self._plan(order, choices)

    def _room(self, line: Line, supply: dict[object, int]) -> int:
        """How much more than it asks a line could take with nothing else placed: devices (distinct domains,
        under spread) or whole blocks' bytes. ``supply`` gains what it could take from each group or pool."""
        _, r, pin = line
        if r.carved:
            pools = self.placer.inv.pools
            usable: dict[object, int] = {}
            for p in self.placer._pool_candidates(self.host, r, {}, {}):
                block = pools[p.pool].info.capacity.block_bytes
                usable[p.pool] = p.free_bytes // block * block
            supply.update(usable)
            return sum(usable.values()) - r.amount_bytes
        groups = self.placer._groups(self.host, r, pin, {})
        supply.update((g.key, g.free) for g in groups)
        if r.spread:
            values = {g.failure_domains.get(r.spread) for g in groups} - {None} - set(pin.used_domains)
            return len(values) - r.count
        return sum(g.free for g in groups) - r.count

    def _fits_alone(self, line: Line) -> bool:
        """Whether a same-switch line fits with nothing else placed (for others, `_room` says as much)."""
        _, r, pin = line
        same_switch = r.affinity is Affinity.SAME_SWITCH and pin.switch is None
        return not same_switch or isinstance(self.placer._attempt(self.host, [line]), Plan)

    def _state(self, depth: int) -> tuple[object, ...]:
        return (
            depth,
            frozenset(kv for kv in self.devices.items() if kv[1]),
            frozenset(kv for kv in self.pool_bytes.items() if kv[1]),
            frozenset(kv for kv in self.pool_lds.items() if kv[1]),
        )

    def _descend(self, order: Sequence[Line], depth: int) -> list[DeviceChoice | MemoryChoice] | None:
        """Choices for ``order[depth:]`` given what the earlier lines took, or None."""
        if depth == len(order):
            return []
        state = self._state(depth)
        if state in self.failed:
            return None
        for choice in self._choices(order[depth]):
            if self.steps == SEARCH_STEPS or not self.budget.left:
                self.cut = True
                return None
            self.steps += 1
            self.budget.left -= 1
            self._hold(choice, 1)
            rest = self._descend(order, depth + 1)
            if rest is not None:
                return [choice, *rest]
            self._hold(choice, -1)
            if self.cut:
                return None
        self.failed.add(state)
        return None

    def _choices(self, line: Line) -> Iterator[DeviceChoice | MemoryChoice]:
        _, r, pin = line
        placer = self.placer
        if r.carved:
            pools = placer._ordered_pools(
                placer._pool_candidates(self.host, r, self.pool_bytes, self.pool_lds), r.amount_bytes
            )
            blocks = [placer.inv.pools[p.pool].info.capacity.block_bytes for p in pools]
            yield from _portions(pools, blocks, r.amount_bytes)
            return
        groups = placer._groups(self.host, r, pin, self.devices)
        if r.affinity is Affinity.SAME_SWITCH and pin.switch is None:
            for switch in placer._switches(groups, r, pin):
                on_switch = [g for g in groups if g.switch == switch]
                yield from _splits(placer._ordered_groups(on_switch), r.count, r.spread, pin.used_domains)
            return
        yield from _splits(placer._ordered_groups(groups), r.count, r.spread, pin.used_domains)

    def _hold(self, choice: DeviceChoice | MemoryChoice, sign: int) -> None:
        """Take (``sign`` 1) or give back (-1) what ``choice`` takes."""
        for what, n in choice:
            if isinstance(what, DeviceGroup):
                self.devices[what.key] = self.devices.get(what.key, 0) + sign * n
            else:
                self.pool_bytes[what.pool] = self.pool_bytes.get(what.pool, 0) + sign * n
                if self.placer.inv.pools[what.pool].free_lds is not None:
                    self.pool_lds[what.pool] = self.pool_lds.get(what.pool, 0) + sign

    def _plan(self, order: Sequence[Line], choices: Sequence[DeviceChoice | MemoryChoice]) -> Plan:
        """The picks of the choices found: each line's devices from its groups, after those earlier lines took."""
        start: dict[int, int] = {}
        devices: list[DevicePick] = []
        memory: list[MemoryPick] = []
        for (idx, _, _), choice in zip(order, choices, strict=True):
            for what, n in choice:
                if isinstance(what, DeviceGroup):
                    at = start.get(what.key, 0)
                    start[what.key] = at + n
                    bucket = self.placer.inv.buckets[what.key]
                    devices.extend(DevicePick(d, idx, what.latency_ns) for d in bucket.free[at : at + n])
                else:
                    memory.append(MemoryPick(what.pool, n, idx, what.latency_ns))
        return Plan(self.host, tuple(devices), tuple(memory))
