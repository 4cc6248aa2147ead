"""Loads plugins: built-in modules first, then the entry-point group ``disagg.drivers``.

An entry point that fails to import is reported (``Plugins.broken``, ``disagg plugins``) and the others still
load, so one broken driver package does not take every fabric down with it. A plugin that loads but registers
nothing (``Plugins.inert``) is logged as a warning: pluggy skips a hook function that lacks ``@disagg.hookimpl``
without a word, and the driver would only be missed later.

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

HOOKS = tuple(sorted(name for name in vars(hookspecs) if name.startswith("disagg_")))
"""The hooks a plugin may implement."""

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
    inert: dict[str, str] = attrs.field(factory=dict)
    """Plugins (not the built-ins) that loaded but registered nothing, with what to check."""
    sharing_policies: dict[str, SharingPolicySpec] = attrs.field(factory=dict)

    def driver(self, name: str) -> DriverSpec:
        try:
            return self.drivers[name]
        except KeyError:
            pass
        if name in self.inert:  # its entry point is there and loaded: what is wrong is its registration
            raise PluginError(
                f"no driver {name!r} is installed: plugin {name!r} loaded but registered no driver; {self.inert[name]}"
            )
        known = ", ".join(sorted(self.drivers)) or "none"
        raise PluginError(
            f"no driver {name!r} is installed (installed: {known}){self._missing(name)}. "
            f"A driver is a package that declares an entry point in the group {ENTRY_POINT_GROUP!r}."
        )

    def _missing(self, name: str) -> str:
        """Where a driver that is not registered may have gone: blocked, or a plugin that failed to load or
        registered nothing. A driver need not have its package's entry-point name, so every such plugin is
        named, unless the one of the driver's name failed to load."""
        if name in self.broken:
            return f"; its plugin failed to load: {self.broken[name]}"
        hint = f"; plugins blocked by {DISABLE_ENV}: {', '.join(self.blocked)}" if self.blocked else ""
        if self.broken:
            failed = "; ".join(f"{ep}: {why}" for ep, why in sorted(self.broken.items()))
            hint += f"; plugins that failed to load (one may provide it): {failed}"
        if self.inert:
            idle = "; ".join(f"{plugin}: {why}" for plugin, why in sorted(self.inert.items()))
            hint += f"; plugins that loaded but registered nothing (one may be meant to provide it): {idle}"
        return hint

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
        if not pm.is_blocked(name) and not _registered_already(pm, name, plugin):
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
                plugin = ep.load()
                if pm.is_registered(plugin):  # given by hand too (disagg certify --plugin): taken once, by that name
                    continue
                pm.register(plugin, name=ep.name)
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
    inert = _inert(pm, drivers, policies)

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
        inert=inert,
    )


def _registered_already(pm: pluggy.PluginManager, name: str, plugin: object) -> bool:
    """Whether ``plugin`` is registered already: a built-in module, or one given twice (``disagg certify --plugin
    M --plugin M``). It is taken once, as asked. Another object under a name that is taken is an error, where
    pluggy would raise a ValueError."""
    if pm.is_registered(plugin):
        return True
    if pm.get_plugin(name) is not None:
        raise PluginError(f"two different plugins are named {name!r}: {pm.get_plugin(name)!r} and {plugin!r}")
    return False


def _inert(pm: pluggy.PluginManager, drivers: DriverRegistry, policies: PolicyRegistry) -> dict[str, str]:
    """The plugins, other than the built-ins, that registered nothing, each with what to check, logged as a
    warning. Most often the hook function lacks ``@disagg.hookimpl``, which pluggy skips without a word; when the
    module has such a function, that is said outright."""
    owners = {d.plugin for d in drivers.drivers.values()} | set(policies.owners.values())
    owners |= {s.plugin for s in policies.sharing.values()}
    found = {}
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin) or ""
        if name in BUILTIN_PLUGINS or name in owners:
            continue
        marked = {caller.name for caller in pm.get_hookcallers(plugin) or ()}
        unmarked = [hook for hook in HOOKS if callable(getattr(plugin, hook, None)) and hook not in marked]
        if unmarked:
            why = f"its {', '.join(unmarked)} lacks @disagg.hookimpl, and pluggy calls only marked functions"
        elif marked:
            why = f"its {', '.join(sorted(marked))} ran and registered nothing (does it register only when a library "
            why += "or a device it needs is there?)"
        else:
            why = "is its disagg_register_drivers marked with @disagg.hookimpl? pluggy calls only marked functions"
        log.warning("plugin %s loaded but registered nothing: %s", name, why)
        found[name] = why
    return found


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
