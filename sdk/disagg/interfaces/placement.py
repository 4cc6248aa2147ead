"""The placement-policy interface: how a policy chooses among groups of equivalent candidates.

The composer's index hands a policy groups, never single devices: a group is the free devices of one kind
and one attribute signature hanging off one switch, all equally far from the host. Choosing among groups
keeps placement independent of how many devices a fabric has.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import attrs

from disagg.model._quick import quick_init


@quick_init
@attrs.frozen
class DeviceGroup:
    """Free, interchangeable devices on one switch, ``latency_ns`` from the host."""

    key: int
    switch: str
    latency_ns: int
    free: int
    failure_domains: Mapping[str, str]


@attrs.frozen
class PoolCandidate:
    """A memory pool reachable from the host with its free bytes."""

    pool: str
    switch: str
    latency_ns: int
    free_bytes: int


class PlacementPolicy(abc.ABC):
    """Chooses devices and pools for one resource line, for one host. Must be deterministic.

    The placer checks every answer: a group, switch or pool that was not offered (an answer must be the offered
    object or equal to it), or an exception other than a `disagg.errors.DisaggError`, is refused with a
    `disagg.errors.PluginError` naming the policy, and nothing is placed. A policy may leave out candidates it
    does not want; the placer's search after a failed greedy pass only tries what the policy answers.
    """

    name: str = ""
    description: str = ""

    @abc.abstractmethod
    def choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        """For same-switch affinity: the switch to take ``need`` devices from, or None if none has enough.

        ``groups`` is sorted by (latency, switch, key); every group shares the requested kind and selectors.
        The policy is asked again, without the switch it chose, when that switch cannot serve the line, and by
        the search for the next switch to try: its answers in turn are its order of preference. For a line with
        spread, only switches whose groups span ``need`` distinct domains are offered.
        """

    @abc.abstractmethod
    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        """The order in which groups are drained when devices may come from several switches."""

    @abc.abstractmethod
    def order_pools(self, pools: Sequence[PoolCandidate], amount_bytes: int) -> Sequence[PoolCandidate]:
        """The order in which pools are carved; the first that holds the whole amount is used alone."""
