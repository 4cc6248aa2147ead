"""The hook specifications of disagg: every hook a plugin may implement.

Hooks are called once, when the plugin manager loads, after every plugin is registered, so none is
``historic``; each registration hook collects from every plugin, so none is ``firstresult``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from disagg.plugins.registry import DriverRegistry, PolicyRegistry

hookspec = pluggy.HookspecMarker("disagg")


@hookspec
def disagg_register_drivers(registry: DriverRegistry) -> None:
    """Register fabric types with ``registry.add_driver(name, factory, capabilities=...)``."""


@hookspec
def disagg_register_policies(registry: PolicyRegistry) -> None:
    """Register placement policies with ``registry.add_placement_policy(policy)``, and policies for GPU-sharing
    workloads (the trace replay's) with ``registry.add_sharing_policy(name, factory)``."""
