"""Loads plugins: built-in modules first, then the entry-point group ``disagg.drivers``.

An entry point that fails to import is reported (``Plugins.broken``, ``disagg plugins``) and the others still
load, so one broken driver package does not take every fabric down with it.

Operators can block plugins by name with ``DISAGG_DISABLE_PLUGINS=a,b`` and see every hook call logged at
DEBUG level on the ``disagg.plugins`` logger.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import attrs
import pluggy

from disagg.errors import PluginError
from disagg.interfaces.placement import PlacementPolicy
from disagg.plugins import hookspecs
from disagg.plugins.registry import DriverRegistry, DriverSpec, PolicyRegistry, SharingPolicySpec

ENTRY_POINT_GROUP = "disagg.drivers"
DISABLE_ENV = "DISAGG_DISABLE_PLUGINS"
BUILTIN_PLUGINS = ("disagg.policies", "disagg.remote.plugin")

log = logging.getLogger("disagg.plugins")


@attrs.frozen
class PluginInfo:
    """One loaded plugin, for ``disagg plugins``."""

    name: str
    distribution: str
    version: str
    drivers: tuple[str, ...]
    policies: tuple[str, ...]
    sharing_policies: tuple[str, ...] = ()


@attrs.frozen
class Plugins:
    """What the loaded plugins offer."""

    drivers: dict[str, DriverSpec]
    policies: dict[str, PlacementPolicy]
    plugins: tuple[PluginInfo, ...]
    blocked: tuple[str, ...]
    broken: dict[str, str] = attrs.field(factory=dict)
    """Entry points that failed to load, with the reason; the others still work."""
    sharing_policies: dict[str, SharingPolicySpec] = attrs.field(factory=dict)

    def driver(self, name: str) -> DriverSpec:
        try:
            return self.drivers[name]
        except KeyError:
            known = ", ".join(sorted(self.drivers)) or "none"
            hint = f"; plugins blocked by {DISABLE_ENV}: {', '.join(self.blocked)}" if self.blocked else ""
            if name in self.broken:
                hint = f"; its plugin failed to load: {self.broken[name]}"
            elif self.broken:  # a driver need not have its package's entry-point name: name every failure
                failed = "; ".join(f"{ep}: {why}" for ep, why in sorted(self.broken.items()))
                hint += f"; plugins that failed to load (one may provide it): {failed}"
            raise PluginError(
                f"no driver {name!r} is installed (installed: {known}){hint}. "
                f"A driver is a package that declares an entry point in the group {ENTRY_POINT_GROUP!r}."
            ) from None

    def policy(self, name: str) -> PlacementPolicy:
        try:
            return self.policies[name]
        except KeyError:
            known = ", ".join(sorted(self.policies)) or "none"
            raise PluginError(f"no placement policy {name!r} (known: {known})") from None

    def sharing_policy(self, name: str) -> SharingPolicySpec:
        try:
            return self.sharing_policies[name]
        except KeyError:
            known = ", ".join(sorted(self.sharing_policies)) or "none"
            raise PluginError(f"no sharing placement policy {name!r} (known: {known})") from None


def blocked_from_env(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    raw = (environ if environ is not None else dict(os.environ)).get(DISABLE_ENV, "")
    return tuple(sorted({name.strip() for name in raw.split(",") if name.strip()}))


def _call_each(pm: pluggy.PluginManager, hook_name: str, registry: Any) -> None:
    """Call every implementation of a registration hook, telling the registry whose call it is.

    The registry records the plugin that added each part, and a plugin that raises is named in the error.
    """
    caller = getattr(pm.hook, hook_name)
    for impl in reversed(caller.get_hookimpls()):
        name = impl.plugin_name
        registry.plugin = name
        log.debug("calling %s.%s", name, hook_name)
        kwargs = {arg: registry for arg in impl.argnames}
        try:
            impl.function(**kwargs)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin {name!r} failed in {hook_name}: {exc!r}") from exc


def load_plugins(
    *,
    entry_points: bool = True,
    extra: Iterable[tuple[str, object]] = (),
    blocked: Iterable[str] | None = None,
) -> Plugins:
    """Build a plugin manager, register built-ins, ``extra`` (name, module) pairs and entry points, then
    collect drivers and policies."""
    pm = pluggy.PluginManager("disagg")
    pm.add_hookspecs(hookspecs)
    blocked_names = tuple(blocked) if blocked is not None else blocked_from_env()
    for name in blocked_names:
        pm.set_blocked(name)
    for module_name in BUILTIN_PLUGINS:
        if not pm.is_blocked(module_name):
            pm.register(importlib.import_module(module_name), name=module_name)
    dists: dict[str, tuple[str, str]] = {}
    for name, plugin in extra:
        if not pm.is_blocked(name):
            try:
                pm.register(plugin, name=name)
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"plugin {name!r} does not match the hook specifications: {exc}") from exc
            dists[name] = _distribution_of(plugin)
    broken: dict[str, str] = {}
    if entry_points:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
                continue
            try:
                pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # an import error or a hook that does not match its spec
                log.debug("plugin %s (%s) failed to load: %r", ep.name, ep.value, exc)
                broken[ep.name] = f"{ep.value}: {exc!r}"
                continue
            if ep.dist is not None:
                dists[ep.name] = (ep.dist.name, ep.dist.version)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements an unknown hook: {exc}") from exc

    drivers = DriverRegistry()
    _call_each(pm, "disagg_register_drivers", drivers)
    policies = PolicyRegistry()
    _call_each(pm, "disagg_register_policies", policies)

    infos = []
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin) or ""
        dist_name, dist_version = dists.get(name, ("disagg (built-in)", _own_version()))
        infos.append(
            PluginInfo(
                name=name,
                distribution=dist_name,
                version=dist_version,
                drivers=tuple(sorted(n for n, d in drivers.drivers.items() if d.plugin == name)),
                policies=tuple(sorted(n for n, o in policies.owners.items() if o == name)),
                sharing_policies=tuple(sorted(n for n, p in policies.sharing.items() if p.plugin == name)),
            )
        )
    return Plugins(
        drivers=drivers.drivers,
        policies=policies.policies,
        plugins=tuple(sorted(infos, key=lambda i: i.name)),
        blocked=blocked_names,
        broken=broken,
        sharing_policies=policies.sharing,
    )


def _distribution_of(plugin: object) -> tuple[str, str]:
    """The installed distribution (name, version) that provides a plugin module given by hand rather than by an
    entry point, or what it is when no installed distribution provides it: a certification report names it."""
    module = getattr(plugin, "__name__", repr(plugin))
    for dist in metadata.packages_distributions().get(module.partition(".")[0], []):
        return dist, metadata.version(dist)
    return f"{module} (no installed distribution)", "unknown"


def _own_version() -> str:
    from disagg import __version__

    return __version__
