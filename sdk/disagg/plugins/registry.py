"""Registries handed to registration hooks; they validate what plugins add."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from disagg.errors import PluginError
from disagg.interfaces import Fabric
from disagg.interfaces.placement import PlacementPolicy
from disagg.model import Capabilities

FabricFactory = Callable[[str, Mapping[str, Any]], Fabric]
"""Builds a fabric instance from its configured name and its driver options."""
CertifyOptions = Callable[[Path], Mapping[str, Any]]
"""The driver options `disagg certify` uses when given no configuration, for a fresh work directory: a small
fabric of the driver's own whose state lives in that directory."""

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


@attrs.frozen
class DriverSpec:
    """A fabric type offered by a plugin."""

    name: str
    factory: FabricFactory
    capabilities: Capabilities
    description: str
    plugin: str
    certify_options: CertifyOptions | None = None


class _Registry:
    def __init__(self) -> None:
        self.plugin = ""

    def _check_name(self, what: str, name: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(
                f"plugin {self.plugin!r} registered a {what} named {name!r}: "
                "names are lower-case letters, digits and dashes, starting with a letter"
            )

    def _taken(self, what: str, name: str, owner: str) -> PluginError:
        """The error for a second registration of ``name``, which ``owner`` made first."""
        if owner == self.plugin:
            return PluginError(f"plugin {owner!r} registers {what} {name!r} twice")
        return PluginError(f"{what} {name!r} is registered by both {owner!r} and {self.plugin!r}")


class DriverRegistry(_Registry):
    """Collects fabric types; a name may be registered once."""

    def __init__(self) -> None:
        super().__init__()
        self.drivers: dict[str, DriverSpec] = {}

    def add_driver(
        self,
        name: str,
        factory: FabricFactory,
        *,
        capabilities: Capabilities,
        description: str = "",
        certify_options: CertifyOptions | None = None,
    ) -> None:
        self._check_name("driver", name)
        if not callable(factory):
            raise PluginError(f"plugin {self.plugin!r}: the factory of driver {name!r} is not callable")
        if not isinstance(capabilities, Capabilities):
            raise PluginError(f"plugin {self.plugin!r}: driver {name!r} must declare Capabilities")
        if name in self.drivers:
            raise self._taken("driver", name, self.drivers[name].plugin)
        if certify_options is not None and not callable(certify_options):
            raise PluginError(f"plugin {self.plugin!r}: the certify_options of driver {name!r} is not callable")
        self.drivers[name] = DriverSpec(name, factory, capabilities, description, self.plugin, certify_options)


@attrs.frozen
class SharingPolicySpec:
    """A placement policy for GPU-sharing workloads (`disagg.replay.policy.SharingPolicy`), made on demand so
    that registering it imports nothing heavy."""

    name: str
    factory: Callable[[], Any]
    description: str
    plugin: str


class PolicyRegistry(_Registry):
    """Collects placement policies; a name may be registered once per kind."""

    def __init__(self) -> None:
        super().__init__()
        self.policies: dict[str, PlacementPolicy] = {}
        self.owners: dict[str, str] = {}
        self.sharing: dict[str, SharingPolicySpec] = {}

    def add_sharing_policy(self, name: str, factory: Callable[[], Any], *, description: str = "") -> None:
        """Register a factory of a `SharingPolicy` (a host-choosing policy for GPU-sharing workloads, as the
        trace replay compares); ``factory()`` must return a fresh instance named ``name``."""
        self._check_name("sharing policy", name)
        if not callable(factory):
            raise PluginError(f"plugin {self.plugin!r}: the factory of sharing policy {name!r} is not callable")
        if name in self.sharing:
            raise self._taken("sharing policy", name, self.sharing[name].plugin)
        self.sharing[name] = SharingPolicySpec(name, factory, description, self.plugin)

    def add_placement_policy(self, policy: PlacementPolicy) -> None:
        if not isinstance(policy, PlacementPolicy):
            raise PluginError(f"plugin {self.plugin!r} registered {policy!r}, which is not a PlacementPolicy")
        self._check_name("placement policy", policy.name)
        if policy.name in self.policies:
            raise self._taken("placement policy", policy.name, self.owners[policy.name])
        self.policies[policy.name] = policy
        self.owners[policy.name] = self.plugin
