"""Unit tests of plugin loading (`disagg.plugins`): hooks, validated registries, blocking and listing.

Every hook of `disagg.plugins.hookspecs` has an implementation in this file that a test calls; test_docs.py
checks that.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import disagg
import disagg.policies
import disagg.remote.plugin
import disagg_sim.plugin
import pytest
from disagg.errors import PluginError
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.model import Capabilities, DeviceKind, Feature
from disagg.plugins import DISABLE_ENV, DriverRegistry, PluginInfo, Plugins, PolicyRegistry, load_plugins
from disagg.plugins.manager import blocked_from_env
from disagg.policies import BestFit, Closest

CAPS = Capabilities({DeviceKind.GPU}, {Feature.BIND, Feature.UNBIND})


def _factory(name: str, options: Mapping[str, Any]) -> Any:
    return ("fabric", name, dict(options))


def _load(*extra: tuple[str, object], blocked: Sequence[str] = ()) -> Plugins:
    return load_plugins(entry_points=False, extra=list(extra), blocked=list(blocked))


class DriverPlugin:
    """Registers one driver, or several when asked."""

    def __init__(self, *names: str, description: str = "") -> None:
        self.names = names or ("fake",)
        self.description = description
        self.calls = 0

    @disagg.hookimpl
    def disagg_register_drivers(self, registry: DriverRegistry) -> None:
        self.calls += 1
        for name in self.names:
            registry.add_driver(name, _factory, capabilities=CAPS, description=self.description)


class Quiet(PlacementPolicy):
    """A policy that keeps the given order."""

    name = "quiet"
    description = "keeps the order it is given"

    def choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        return groups[0].switch if groups else None

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        return list(groups)

    def order_pools(self, pools: Sequence[PoolCandidate], amount_bytes: int) -> Sequence[PoolCandidate]:
        return list(pools)


class PolicyPlugin:
    def __init__(self, policy: object) -> None:
        self.policy = policy
        self.calls = 0

    @disagg.hookimpl
    def disagg_register_policies(self, registry: PolicyRegistry) -> None:
        self.calls += 1
        registry.add_placement_policy(self.policy)  # type: ignore[arg-type]


class TestHooksAreCalled:
    """Each registration hook is called once per plugin with a registry of the right type."""

    def test_disagg_register_drivers(self) -> None:
        plugin = DriverPlugin("fake", description="a fake fabric")
        plugins = _load(("fakeplug", plugin))
        assert plugin.calls == 1
        spec = plugins.driver("fake")
        assert (spec.name, spec.plugin, spec.description) == ("fake", "fakeplug", "a fake fabric")
        assert spec.capabilities == CAPS
        assert spec.factory("f0", {"a": 1}) == ("fabric", "f0", {"a": 1})

    def test_disagg_register_policies(self) -> None:
        policy = Quiet()
        plugin = PolicyPlugin(policy)
        plugins = _load(("quietplug", plugin))
        assert plugin.calls == 1
        assert plugins.policy("quiet") is policy
        assert set(plugins.policies) == {"best-fit", "closest", "quiet"}

    def test_registry_types(self) -> None:
        seen: list[type] = []

        class Both:
            @disagg.hookimpl
            def disagg_register_drivers(self, registry: DriverRegistry) -> None:
                seen.append(type(registry))

            @disagg.hookimpl
            def disagg_register_policies(self, registry: PolicyRegistry) -> None:
                seen.append(type(registry))

        _load(("both", Both()))
        assert seen == [DriverRegistry, PolicyRegistry]

    def test_module_as_plugin(self) -> None:
        module = types.ModuleType("fake_driver_module")

        @disagg.hookimpl
        def disagg_register_drivers(registry: DriverRegistry) -> None:
            registry.add_driver("modfake", _factory, capabilities=CAPS)

        module.disagg_register_drivers = disagg_register_drivers  # type: ignore[attr-defined]
        assert _load(("modplug", module)).driver("modfake").plugin == "modplug"

    def test_implementation_may_take_no_arguments(self) -> None:
        calls: list[str] = []

        class NoArgs:
            @disagg.hookimpl
            def disagg_register_drivers(self) -> None:
                calls.append("called")

        _load(("noargs", NoArgs()))
        assert calls == ["called"]

    def test_several_plugins_and_drivers(self) -> None:
        plugins = _load(("p1", DriverPlugin("a", "b")), ("p2", DriverPlugin("c")))
        assert {n: d.plugin for n, d in plugins.drivers.items()} == {
            "a": "p1",
            "b": "p1",
            "c": "p2",
            "remote": "disagg.remote.plugin",
        }
        info = {p.name: p for p in plugins.plugins}
        assert info["p1"].drivers == ("a", "b")
        assert info["p2"].drivers == ("c",)


class TestDriverRegistry:
    """DriverRegistry refuses bad names, non-callable factories, missing Capabilities and duplicates."""

    def _registry(self) -> DriverRegistry:
        registry = DriverRegistry()
        registry.plugin = "acme"
        return registry

    @pytest.mark.parametrize("name", ["a", "sim", "sim-2", "cxl-fm", "a" * 63])
    def test_good_names(self, name: str) -> None:
        registry = self._registry()
        registry.add_driver(name, _factory, capabilities=CAPS)
        assert registry.drivers[name].plugin == "acme"

    @pytest.mark.parametrize("name", ["", "Sim", "2sim", "-sim", "sim_2", "sim 2", "sim.x", "a" * 64, "sïm", 3, None])
    def test_bad_names(self, name: Any) -> None:
        with pytest.raises(PluginError, match="names are lower-case letters") as info:
            self._registry().add_driver(name, _factory, capabilities=CAPS)
        assert "'acme'" in info.value.message
        assert repr(name) in info.value.message

    @pytest.mark.parametrize("factory", [None, "module:factory", 3])
    def test_factory_not_callable(self, factory: Any) -> None:
        with pytest.raises(PluginError, match="plugin 'acme': the factory of driver 'x' is not callable"):
            self._registry().add_driver("x", factory, capabilities=CAPS)

    @pytest.mark.parametrize("caps", [None, {"kinds": ["gpu"]}, "gpu"])
    def test_capabilities_required(self, caps: Any) -> None:
        with pytest.raises(PluginError, match="plugin 'acme': driver 'x' must declare Capabilities"):
            self._registry().add_driver("x", _factory, capabilities=caps)

    def test_duplicate_in_one_plugin(self) -> None:
        """The error said "registered by both 'acme' and 'acme'", as if two plugins clashed."""
        registry = self._registry()
        registry.add_driver("x", _factory, capabilities=CAPS)
        with pytest.raises(PluginError, match=r"^plugin 'acme' registers driver 'x' twice$"):
            registry.add_driver("x", _factory, capabilities=CAPS)

    def test_duplicate_across_plugins_names_both(self) -> None:
        with pytest.raises(PluginError) as info:
            _load(("first", DriverPlugin("fake")), ("second", DriverPlugin("fake")))
        assert "driver 'fake'" in info.value.message
        assert "'first'" in info.value.message
        assert "'second'" in info.value.message

    def test_bad_name_through_a_plugin_names_it(self) -> None:
        with pytest.raises(PluginError, match="plugin 'shouty' registered a driver named 'LOUD'"):
            _load(("shouty", DriverPlugin("LOUD")))


def _acme_policies() -> PolicyRegistry:
    """A policy registry as the hook of plugin 'acme' receives it."""
    registry = PolicyRegistry()
    registry.plugin = "acme"
    return registry


class TestPolicyRegistry:
    """PolicyRegistry refuses objects that are not policies, bad names and duplicates."""

    def _registry(self) -> PolicyRegistry:
        return _acme_policies()

    def test_add(self) -> None:
        registry = self._registry()
        policy = Quiet()
        registry.add_placement_policy(policy)
        assert registry.policies == {"quiet": policy}
        assert registry.owners == {"quiet": "acme"}

    @pytest.mark.parametrize("policy", [None, "best-fit", BestFit])
    def test_not_a_policy(self, policy: Any) -> None:
        with pytest.raises(PluginError, match="which is not a PlacementPolicy") as info:
            self._registry().add_placement_policy(policy)
        assert "'acme'" in info.value.message

    @pytest.mark.parametrize("name", ["", "Quiet", "quiet_1", "1quiet"])
    def test_bad_name(self, name: str) -> None:
        policy = Quiet()
        policy.name = name
        with pytest.raises(PluginError, match="registered a placement policy named"):
            self._registry().add_placement_policy(policy)

    def test_duplicate_in_one_plugin(self) -> None:
        registry = self._registry()
        registry.add_placement_policy(Quiet())
        with pytest.raises(PluginError, match=r"^plugin 'acme' registers placement policy 'quiet' twice$"):
            registry.add_placement_policy(Quiet())

    def test_duplicate_across_plugins_names_both(self) -> None:
        imposter = BestFit()
        with pytest.raises(PluginError) as info:
            _load(("imposter", PolicyPlugin(imposter)))
        assert "placement policy 'best-fit'" in info.value.message
        assert "'disagg.policies'" in info.value.message
        assert "'imposter'" in info.value.message


class TestSharingPolicyRegistry:
    """Sharing policies register as factories: a name once, a callable factory, loaded without numpy's cost."""

    def _registry(self) -> PolicyRegistry:
        return _acme_policies()

    def test_add(self) -> None:
        registry = self._registry()
        registry.add_sharing_policy("pack", dict, description="packs")
        spec = registry.sharing["pack"]
        assert (spec.name, spec.factory, spec.description, spec.plugin) == ("pack", dict, "packs", "acme")

    def test_factory_must_be_callable(self) -> None:
        with pytest.raises(PluginError, match="the factory of sharing policy 'pack' is not callable"):
            self._registry().add_sharing_policy("pack", "not a factory")  # type: ignore[arg-type]

    @pytest.mark.parametrize("name", ["", "Pack", "pack_1"])
    def test_bad_name(self, name: str) -> None:
        with pytest.raises(PluginError, match="registered a sharing policy named"):
            self._registry().add_sharing_policy(name, dict)

    def test_duplicate_names_both_plugins(self) -> None:
        registry = self._registry()
        registry.add_sharing_policy("pack", dict)
        registry.plugin = "other"
        with pytest.raises(PluginError, match="sharing policy 'pack' is registered by both 'acme' and 'other'"):
            registry.add_sharing_policy("pack", dict)

    def test_duplicate_in_one_plugin(self) -> None:
        registry = self._registry()
        registry.add_sharing_policy("pack", dict)
        with pytest.raises(PluginError, match=r"^plugin 'acme' registers sharing policy 'pack' twice$"):
            registry.add_sharing_policy("pack", dict)

    def test_built_ins_make_fresh_policies(self) -> None:
        plugins = _load()
        made = [plugins.sharing_policy(n).factory() for n in ("best-fit", "fgd", "frag-balance")]
        assert [m.name for m in made] == ["best-fit", "fgd", "frag-balance"]
        assert plugins.sharing_policy("fgd").factory() is not made[1]

    def test_unknown(self) -> None:
        with pytest.raises(PluginError, match=r"no sharing placement policy 'tightest' \(known: best-fit, fgd"):
            _load().sharing_policy("tightest")


class TestFailingPlugins:
    """A plugin with an unknown hook, a malformed implementation or a raising hook is a PluginError naming it."""

    def test_unknown_hook(self) -> None:
        class Misspelled:
            @disagg.hookimpl
            def disagg_register_driverz(self, registry: DriverRegistry) -> None:
                raise AssertionError("never called")

        with pytest.raises(PluginError, match="unknown hook") as info:
            _load(("misspelled", Misspelled()))
        assert "disagg_register_driverz" in info.value.message

    def test_unknown_argument(self) -> None:
        class WrongArgument:
            @disagg.hookimpl
            def disagg_register_drivers(self, reg: DriverRegistry) -> None:
                raise AssertionError("never called")

        with pytest.raises(PluginError) as info:
            _load(("wrongarg", WrongArgument()))
        assert "wrongarg" in info.value.message

    def test_hook_raises(self) -> None:
        class Broken:
            @disagg.hookimpl
            def disagg_register_drivers(self, registry: DriverRegistry) -> None:
                raise RuntimeError("no hardware here")

        with pytest.raises(PluginError) as info:
            _load(("broken", Broken()))
        assert "plugin 'broken' failed in disagg_register_drivers" in info.value.message
        assert "no hardware here" in info.value.message
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_policy_hook_raises(self) -> None:
        class Broken:
            @disagg.hookimpl
            def disagg_register_policies(self, registry: PolicyRegistry) -> None:
                raise KeyError("x")

        with pytest.raises(PluginError, match="plugin 'broken' failed in disagg_register_policies"):
            _load(("broken", Broken()))

    def test_plugin_error_passes_unchanged(self) -> None:
        error = PluginError("my own words")

        class Raises:
            @disagg.hookimpl
            def disagg_register_drivers(self, registry: DriverRegistry) -> None:
                raise error

        with pytest.raises(PluginError) as info:
            _load(("raises", Raises()))
        assert info.value is error


class TestAPluginGivenTwice:
    """A plugin that is registered already (a built-in, one given twice, a module an entry point names too) is
    taken once, as asked, where pluggy raised ValueError ("Plugin name already registered")."""

    def test_a_built_in_given_again(self) -> None:
        plugins = _load(("disagg.policies", disagg.policies), ("disagg.remote.plugin", disagg.remote.plugin))
        assert [p.name for p in plugins.plugins] == ["disagg.policies", "disagg.remote.plugin"]
        assert set(plugins.policies) == {"best-fit", "closest"}

    def test_one_plugin_given_twice(self) -> None:
        plugin = DriverPlugin("fake")
        plugins = _load(("fakeplug", plugin), ("fakeplug", plugin))
        assert plugin.calls == 1
        assert plugins.driver("fake").plugin == "fakeplug"

    def test_a_module_its_entry_point_names_too(self) -> None:
        """``disagg certify sim --plugin disagg_sim.plugin``: the entry point sim names the same module, which
        was reported as a plugin that failed to load."""
        plugins = load_plugins(extra=[("disagg_sim.plugin", disagg_sim.plugin)], blocked=[])
        assert "sim" not in plugins.broken
        assert plugins.driver("sim").plugin == "disagg_sim.plugin"

    def test_two_plugins_of_one_name(self) -> None:
        with pytest.raises(PluginError, match="two different plugins are named 'fakeplug'"):
            _load(("fakeplug", DriverPlugin("a")), ("fakeplug", DriverPlugin("b")))


def _unmarked_plugin() -> types.ModuleType:
    """A plugin module whose disagg_register_drivers lacks @disagg.hookimpl: pluggy never calls it."""
    module = types.ModuleType("acme_plugin")

    def disagg_register_drivers(registry: DriverRegistry) -> None:
        registry.add_driver("acme", _factory, capabilities=CAPS)

    module.disagg_register_drivers = disagg_register_drivers  # type: ignore[attr-defined]
    return module


class TestAPluginThatRegistersNothing:
    """A plugin that loads but registers nothing is warned about, and a request for the driver it was meant to
    register says so, instead of asking for an entry point that is there."""

    def test_an_unmarked_hook_is_named(self, caplog: pytest.LogCaptureFixture) -> None:
        plugins = _load(("acme", _unmarked_plugin()))
        assert plugins.inert == {
            "acme": "its disagg_register_drivers lacks @disagg.hookimpl, and pluggy calls only marked functions"
        }
        with pytest.raises(PluginError) as info:
            plugins.driver("acme")
        assert info.value.message == (
            "no driver 'acme' is installed: plugin 'acme' loaded but registered no driver; its "
            "disagg_register_drivers lacks @disagg.hookimpl, and pluggy calls only marked functions"
        )
        warned = [r.getMessage() for r in caplog.records if r.name == "disagg.plugins" and r.levelname == "WARNING"]
        assert warned == [f"plugin acme loaded but registered nothing: {plugins.inert['acme']}"]

    def test_a_plugin_with_no_hook_is_asked_about_its_mark(self) -> None:
        plugins = _load(("acme", types.ModuleType("acme_plugin")))
        assert "is its disagg_register_drivers marked with @disagg.hookimpl?" in plugins.inert["acme"]

    def test_a_marked_hook_that_registered_nothing_is_not_asked_about_its_mark(self) -> None:
        """Its hook ran (a library it needs may be missing): asking whether it is marked misled its author."""
        module = types.ModuleType("hw_plugin")

        @disagg.hookimpl
        def disagg_register_drivers(registry: DriverRegistry) -> None:
            return None

        module.disagg_register_drivers = disagg_register_drivers  # type: ignore[attr-defined]
        why = _load(("hw", module)).inert["hw"]
        assert why.startswith("its disagg_register_drivers ran and registered nothing"), why
        assert "marked" not in why

    def test_a_driver_of_another_name_names_the_plugin(self) -> None:
        with pytest.raises(PluginError) as info:
            _load(("acme_plugin", _unmarked_plugin())).driver("acme")
        assert "plugins that loaded but registered nothing (one may be meant to provide it): acme_plugin: " in (
            info.value.message
        )

    def test_plugins_that_register_something_are_not_inert(self) -> None:
        assert _load(("p", DriverPlugin("a")), ("q", PolicyPlugin(Quiet()))).inert == {}


class TestBlocking:
    """Blocked plugins are not loaded, are listed as blocked, and a request for their driver says so."""

    def test_blocked_plugin_is_not_loaded(self) -> None:
        plugin = DriverPlugin("fake")
        plugins = _load(("fake", plugin), blocked=["fake"])
        assert plugin.calls == 0
        assert "fake" not in plugins.drivers
        assert plugins.blocked == ("fake",)
        assert "fake" not in {p.name for p in plugins.plugins}

    def test_driver_of_blocked_plugin_says_blocked(self) -> None:
        plugins = _load(("fake", DriverPlugin("fake")), ("other", DriverPlugin("other")), blocked=["fake"])
        with pytest.raises(PluginError, match=f"no driver 'fake' is installed .*blocked by {DISABLE_ENV}") as info:
            plugins.driver("fake")
        assert "installed: other" in info.value.message

    def test_unknown_driver_is_not_called_blocked(self) -> None:
        plugins = _load(("other", DriverPlugin("other")), blocked=["fake"])
        with pytest.raises(PluginError, match="no driver 'nope' is installed") as info:
            plugins.driver("nope")
        assert "'nope' is blocked" not in info.value.message
        assert f"plugins blocked by {DISABLE_ENV}: fake" in info.value.message
        assert "disagg.drivers" in info.value.message

    def test_an_unknown_driver_names_the_plugins_that_failed_to_load(self) -> None:
        """The driver `acme` comes from the entry point `acme_plugin`, whose module did not import: the error
        for `acme` still says why, though the two names differ."""
        plugins = attrs.evolve(
            _load(("other", DriverPlugin("other"))),
            broken={"acme_plugin": "acme.plugin: ModuleNotFoundError(\"No module named 'acme_sdk'\")"},
        )
        with pytest.raises(PluginError) as info:
            plugins.driver("acme")
        assert "plugins that failed to load (one may provide it): acme_plugin: acme.plugin: " in info.value.message
        assert "No module named 'acme_sdk'" in info.value.message

    def test_no_driver_at_all(self) -> None:
        with pytest.raises(PluginError, match=r"installed: none"):
            _load(blocked=["disagg.remote.plugin"]).driver("sim")

    def test_blocking_the_built_in_policies(self) -> None:
        plugins = _load(blocked=["disagg.policies"])
        assert plugins.policies == {}
        with pytest.raises(PluginError, match=r"no placement policy 'best-fit' \(known: none\)"):
            plugins.policy("best-fit")

    def test_blocked_from_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(DISABLE_ENV, "fake, unrelated")
        plugin = DriverPlugin("fake")
        plugins = load_plugins(entry_points=False, extra=[("fake", plugin)])
        assert plugin.calls == 0
        assert plugins.blocked == ("fake", "unrelated")

    def test_explicit_list_overrides_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(DISABLE_ENV, "fake")
        plugins = load_plugins(entry_points=False, extra=[("fake", DriverPlugin("fake"))], blocked=[])
        assert "fake" in plugins.drivers


class TestBlockedFromEnv:
    """blocked_from_env reads DISAGG_DISABLE_PLUGINS as a comma list, trimmed, deduplicated and sorted."""

    @pytest.mark.parametrize(
        ("value", "names"),
        [
            ("", ()),
            ("a", ("a",)),
            ("b,a", ("a", "b")),
            (" b , a ,, a ,", ("a", "b")),
            (" , ", ()),
            ("disagg.policies", ("disagg.policies",)),
        ],
    )
    def test_parse(self, value: str, names: tuple[str, ...]) -> None:
        assert blocked_from_env({DISABLE_ENV: value}) == names

    def test_unset(self) -> None:
        assert blocked_from_env({}) == ()

    def test_process_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(DISABLE_ENV, "x,y")
        assert blocked_from_env() == ("x", "y")


class TestBuiltIn:
    """The built-in policies best-fit and closest, and the remote driver, load through the plugin manager and are
    listed as built-in."""

    def test_policies(self) -> None:
        plugins = _load()
        assert set(plugins.policies) == {"best-fit", "closest"}
        assert isinstance(plugins.policy("best-fit"), BestFit)
        assert isinstance(plugins.policy("closest"), Closest)
        assert set(plugins.drivers) == {"remote"}

    def test_plugin_info(self) -> None:
        policies, remote = _load().plugins
        assert remote == PluginInfo(
            name="disagg.remote.plugin",
            distribution="disagg (built-in)",
            version=disagg.__version__,
            drivers=("remote",),
            policies=(),
        )
        assert policies == PluginInfo(
            name="disagg.policies",
            distribution="disagg (built-in)",
            version=disagg.__version__,
            drivers=(),
            policies=("best-fit", "closest"),
            sharing_policies=("best-fit", "fgd", "frag-balance"),
        )

    def test_plugins_sorted_by_name(self) -> None:
        plugins = _load(("zz", DriverPlugin("z")), ("aa", DriverPlugin("a")))
        assert [p.name for p in plugins.plugins] == ["aa", "disagg.policies", "disagg.remote.plugin", "zz"]

    def test_unknown_policy(self) -> None:
        with pytest.raises(PluginError, match=r"no placement policy 'tightest' \(known: best-fit, closest\)"):
            _load().policy("tightest")
