"""The emulated switch restarted under live compositions, with the composer on a SQLite ledger: a restarted switch
holds no binding and no allocation. The driver reports the restart (RESYNC_REQUIRED), and the pass it runs at
once degrades what the switch lost, naming it, and quarantines nothing; a heal does not bring lost devices back
(docs/durability.md); a decompose then leaves nothing behind, and a new Compose carves the capacity the restart
freed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cxl_switch_client import emulator_process
from cxl_switch_wire import dc_extent_bytes, held_vppbs
from disagg.composer import FabricComposer
from disagg.model import Composition, CompositionState, EventType
from disagg.requestlang import parse_request
from disagg.store.sqlite import SqliteStore
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric

GIB = 1 << 30
TOPOLOGY = {"gpus": 4, "nvme": 0, "ld_count": 4, "mld_capacity_gib": 4, "dc_capacity_gib": 1}
FLAGS = ("--hosts", "2", *(f"--{k.replace('_', '-')}={v}" for k, v in TOPOLOGY.items()))
LIVE = parse_request("live", ["host h1", "gpu x1", "cxl-memory 1GiB pool_kind=mld", "cxl-memory 512MiB pool_kind=dcd"])
QUARANTINES = {EventType.BINDING_QUARANTINED, EventType.ALLOCATION_QUARANTINED}


class Rack:
    """An emulator on a socket of its own (restartable), the driver on it with a state directory (its DCD tags),
    and the composer on a SQLite ledger."""

    def __init__(self, folder: Path, auto_heal: bool) -> None:
        self.socket = folder / "e.sock"
        self._emulator = emulator_process(self.socket, *FLAGS)
        self._emulator.__enter__()
        options = {"address": f"unix:{self.socket}", "state_dir": str(folder / "sw"), "hosts": ["h1", "h2"]}
        self.switch: CxlSwitchFabric = create_fabric("sw", {**options, "gpus": TOPOLOGY["gpus"], "nvme": 0})
        self.composer = FabricComposer(
            {"sw": self.switch}, store=SqliteStore(folder / "ledger.db"), auto_heal=auto_heal
        )
        self.composer.start()

    def restart_switch(self) -> None:
        """Kill the emulator and start a fresh one on the same socket: it holds nothing."""
        self._emulator.__exit__(None, None, None)
        self.socket.unlink()  # a killed emulator leaves its socket behind
        self._emulator = emulator_process(self.socket, *FLAGS)
        self._emulator.__enter__()

    def ports(self) -> dict[str, int]:
        return {
            str(d.attributes["pool_kind"]): int(d.attributes["port"])
            for d in self.switch.discover().devices
            if "pool_kind" in d.attributes
        }

    def free_bytes(self) -> dict[str, int]:
        return {u.pool: u.free_bytes for u in self.composer.usage()[1]}

    def close(self) -> None:
        self.composer.close()
        self.switch.close()
        self._emulator.__exit__(None, None, None)


@pytest.fixture(params=[False, True], ids=["no-heal", "auto-heal"])
def rack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rack]:
    made = Rack(tmp_path, request.param)
    yield made
    made.close()


def test_a_restarted_switch_degrades_what_it_lost_and_gives_it_back_on_decompose(rack: Rack) -> None:
    comp = rack.composer
    live = comp.compose(LIVE).composition
    assert live is not None and live.state is CompositionState.COMPOSED
    lost = (*live.device_ids, *(a.id for a in live.allocations))
    rack.restart_switch()
    seen = comp.revision

    _degraded_within(comp, live.id, 1.0)  # by the pass the driver's RESYNC_REQUIRED runs, not the test's
    comp.wait_for_heals(5.0)
    degraded = comp.get(live.id)
    assert degraded.state is CompositionState.DEGRADED
    assert set(degraded.missing) == set(lost)
    assert degraded.message == f"the hardware no longer holds {', '.join(degraded.missing)}"
    assert degraded.device_ids == live.device_ids, "a heal replaced a device the switch lost (not unhealthy)"
    assert comp.reconcile() == 0
    assert comp.get(live.id) == degraded
    assert not QUARANTINES & {e.type for e in comp.events(seen)}
    assert comp.cordoned_devices() == set()

    comp.decompose(live.id)
    assert comp.compositions() == []
    ports = rack.ports()
    assert held_vppbs(rack.switch.address, [0, 1]) == []
    assert [rack.switch.pool(p.id).allocations() for p in rack.switch.discover().pools] == [[], [], []]
    assert dc_extent_bytes(rack.switch.address, ports["dcd"], 0) == 0
    dcd = f"sw/dcd-port{ports['dcd']}"  # the emulator's two DC regions, a pool each
    assert rack.free_bytes() == {
        f"sw/mld-port{ports['mld']}": 4 * GIB,
        f"{dcd}-region0": GIB // 2,
        f"{dcd}-region1": GIB // 2,
    }

    again = comp.compose(
        parse_request(
            "again", ["host h1", "gpu x4", "cxl-memory 4GiB pool_kind=mld", "cxl-memory 512MiB pool_kind=dcd"]
        )
    ).composition
    assert again is not None and again.state is CompositionState.COMPOSED
    assert comp.reconcile() == 0
    assert comp.get(again.id).state is CompositionState.COMPOSED


def _degraded_within(comp: FabricComposer, comp_id: str, seconds: float) -> Composition:
    """The composition once DEGRADED, waiting up to ``seconds`` for it, with no reconcile pass of the caller's."""
    deadline = time.monotonic() + seconds
    while (now := comp.get(comp_id)).state is not CompositionState.DEGRADED and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


def _states_since(comp: FabricComposer, comp_id: str, revision: int) -> list[str]:
    return [
        e.data["new"]
        for e in comp.events(revision)
        if e.type is EventType.COMPOSITION_STATE_CHANGED and e.subject == comp_id
    ]


def test_a_restarted_switch_has_what_it_lost_degraded_within_a_second(rack: Rack) -> None:
    """The driver reports the restart (RESYNC_REQUIRED) and the composer reads the switch at once: the lost
    composition stood COMPOSED until the next periodic pass, up to a minute later."""
    comp = rack.composer
    live = comp.compose(LIVE).composition
    assert live is not None
    lost = {*live.device_ids, *(a.id for a in live.allocations)}
    seen = comp.revision
    rack.restart_switch()

    degraded = _degraded_within(comp, live.id, 1.0)
    assert degraded.state is CompositionState.DEGRADED
    assert set(degraded.missing) == lost
    assert _states_since(comp, live.id, seen) == [CompositionState.DEGRADED.value]
    assert comp.reconcile() == 0


def test_a_device_failed_before_the_restart_is_never_composed_again_after_it(rack: Rack) -> None:
    """The restart brings the failed device's port up: its health-OK event made the composition COMPOSED though
    the restart had unbound it."""
    comp = rack.composer
    live = comp.compose(LIVE).composition
    assert live is not None
    rack.switch.fail_device(live.device_ids[0], "ECC")
    comp.wait_for_heals(5.0)
    before = comp.get(live.id)  # DEGRADED, or healed (auto-heal) by another GPU
    seen = comp.revision
    rack.restart_switch()

    degraded = _degraded_within(comp, live.id, 1.0)
    assert degraded.state is CompositionState.DEGRADED
    assert set(degraded.missing) == {*before.device_ids, *(a.id for a in before.allocations)}
    time.sleep(0.2)  # the events the switch's restart brings after it
    assert CompositionState.COMPOSED.value not in _states_since(comp, live.id, seen)
    assert comp.get(live.id).state is CompositionState.DEGRADED
