"""Built-in placement policies, registered through the same plugin manager as third-party ones."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from disagg import hookimpl
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.plugins.registry import PolicyRegistry

if TYPE_CHECKING:
    from disagg.replay.policy import SharingPolicy

SHARING = {
    "best-fit": "the domain, GPU and host left with the least free GPU share, then CPU",
    "fgd": "least growth of expected GPU fragmentation under the task mix (Weng et al., ATC 2023; the reference)",
    "frag-balance": "least growth of GPU fragmentation plus GPU share stranded by CPU or memory (ours)",
}
"""The built-in sharing policies (`disagg.replay.policies`), described here so listing them imports nothing."""


_FULLEST_FIRST = operator.attrgetter("free", "latency_ns", "switch", "key")
"""Best-fit's order of groups: the tuple a lambda would make, made in C (a Compose sorts its host's groups)."""


def _switch_totals(groups: Sequence[DeviceGroup]) -> dict[str, tuple[int, int]]:
    """Per switch: (total free, least latency)."""
    totals: dict[str, tuple[int, int]] = {}
    for g in groups:
        free, latency = totals.get(g.switch, (0, g.latency_ns))
        totals[g.switch] = (free + g.free, min(latency, g.latency_ns))
    return totals


class BestFit(PlacementPolicy):
    """Packs: the switch, group and pool with the least free capacity that still fits, nearest first on ties.

    Leaving large free blocks intact keeps room for the next large request.
    """

    name = "best-fit"
    description = "pack onto the fullest switch and pool that still fit"

    def choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        fits = [(free, lat, sw) for sw, (free, lat) in _switch_totals(groups).items() if free >= need]
        return min(fits)[2] if fits else None

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        return sorted(groups, key=_FULLEST_FIRST)

    def order_pools(self, pools: Sequence[PoolCandidate], amount_bytes: int) -> Sequence[PoolCandidate]:
        whole = [p for p in pools if p.free_bytes >= amount_bytes]
        split = [p for p in pools if p.free_bytes < amount_bytes]
        whole.sort(key=lambda p: (p.free_bytes, p.latency_ns, p.pool))
        split.sort(key=lambda p: (-p.free_bytes, p.latency_ns, p.pool))
        return [*whole, *split]


class Closest(PlacementPolicy):
    """Nearest first: the lowest fabric latency from the host wins, then the most free capacity."""

    name = "closest"
    description = "take the devices and pools nearest the host"

    def choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        fits = [(lat, -free, sw) for sw, (free, lat) in _switch_totals(groups).items() if free >= need]
        return min(fits)[2] if fits else None

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        return sorted(groups, key=lambda g: (g.latency_ns, -g.free, g.switch, g.key))

    def order_pools(self, pools: Sequence[PoolCandidate], amount_bytes: int) -> Sequence[PoolCandidate]:
        return sorted(pools, key=lambda p: (p.latency_ns, -p.free_bytes, p.pool))


def _sharing(name: str) -> Callable[[], SharingPolicy]:
    """A factory of the built-in sharing policy ``name``, importing the replay (and numpy) only when called."""

    def make() -> SharingPolicy:
        from disagg.replay import policies

        by_name: dict[str, type[SharingPolicy]] = {
            cls.name: cls
            for cls in (policies.BestFitSharing, policies.FragmentationGradient, policies.FragmentationBalance)
        }
        return by_name[name]()

    return make


@hookimpl
def disagg_register_policies(registry: PolicyRegistry) -> None:
    registry.add_placement_policy(BestFit())
    registry.add_placement_policy(Closest())
    registry.add_sharing_policy("best-fit", _sharing("best-fit"), description=SHARING["best-fit"])
    registry.add_sharing_policy("fgd", _sharing("fgd"), description=SHARING["fgd"])
    registry.add_sharing_policy("frag-balance", _sharing("frag-balance"), description=SHARING["frag-balance"])
