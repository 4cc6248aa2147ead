"""Changes of a live composition on the sim rack: a removal, decompose or heal whose fabric stops answering while
it runs, the refusal and the events of a recompose, the etag guard of the Python API, and the etags a recompose
rolled back leaves valid."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import attrs
import pytest
from composer_helpers import (
    composer,
    hardware_allocations,
    hardware_bindings,
    ledger_allocations,
    ledger_bindings,
    rack,
)
from disagg.composer import FabricComposer, steps
from disagg.errors import (
    ConflictError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
)
from disagg.interfaces import CallContext
from disagg.model import Allocation, Binding, Composition, CompositionState, EventType, Health, Topology
from disagg.remote import DriverServer, RemoteFabric
from disagg.requestlang import parse_request, parse_resource
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric, load_topology
from disagg_sim.fabric import SimPool
from remote_helpers import Plain, eventually

T = TypeVar("T")


def before_first_call(change: steps.Steps[T], hook: Callable[[], None]) -> steps.Steps[T]:
    """``change``, with ``hook`` run just before its first driver call is made: for `steps.run`."""
    value: object = None
    error: Exception | None = None
    hooked = False
    while True:
        try:
            step = change.send(value) if error is None else change.throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        if isinstance(step, steps.Call) and not hooked:
            hooked = True
            hook()
        value, error = None, None
        try:
            value = yield step
        except Exception as exc:
            error = exc


class Silenced:
    """Makes one sim fabric stop answering discovery and report a link event of its own (a fabric event asks only
    its own fabric again), so that the composer rebuilds its index without it; `answer` brings it back."""

    def __init__(self, fabrics: dict[str, SimFabric], silent: str, monkeypatch: pytest.MonkeyPatch):
        self.fabrics, self.silent, self.monkeypatch = fabrics, silent, monkeypatch

    def __call__(self) -> None:
        def down() -> Topology:
            raise FabricUnavailableError(f"fabric {self.silent}: the manager does not answer")

        fabric = self.fabrics[self.silent]
        link = next(link for link in fabric.discover().links if "h1" not in (link.a, link.b))
        self.monkeypatch.setattr(fabric, "discover", down)
        fabric.set_link(link.a, link.b, False)  # its event rebuilds the index, which finds it silent

    def answer(self, comp: FabricComposer) -> None:
        self.monkeypatch.undo()
        assert comp.retry_unreachable() is True


def held(fabrics: dict[str, SimFabric], alloc: Allocation) -> bool:
    """Whether the hardware holds ``alloc``: read from its pool, which answers while discovery does not."""
    return alloc.id in {a.id for a in fabrics["cxl0"].pool(alloc.pool).allocations()}


def quarantines(comp: FabricComposer) -> list[str]:
    return [e.subject for e in comp.events() if e.type is EventType.ALLOCATION_QUARANTINED]


def with_memory() -> tuple[dict[str, SimFabric], FabricComposer, Composition]:
    fabrics = rack()
    comp = composer(fabrics, auto_heal=False)
    c = comp.compose(parse_request("job", ["host h1", "gpu x1", "cxl-memory 1GiB"])).composition
    assert c is not None
    return fabrics, comp, c


class TestAFabricThatStopsAnsweringDuringARemoval:
    """What a removal, decompose or heal could not reach because its fabric stopped answering meanwhile stays
    part of the composition and is reported bound, as the hardware still holds it."""

    def test_a_removal_keeps_the_memory_it_could_not_release(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fabrics, comp, c = with_memory()
        alloc = c.allocations[0]
        silence = Silenced(fabrics, "cxl0", monkeypatch)
        change = comp.recompose_steps(c.id, remove=[alloc.id])
        with pytest.raises(DisaggError, match=f"could not remove {alloc.id} from {c.id}") as failed:
            steps.run(before_first_call(change, silence), comp.store)
        assert failed.value.metadata["bound"] == alloc.id
        kept = comp.get(c.id)
        assert kept.state is CompositionState.UNKNOWN
        assert [a.id for a in kept.allocations] == [alloc.id]
        assert held(fabrics, alloc)
        silence.answer(comp)
        assert comp.get(c.id).state is CompositionState.COMPOSED
        assert ledger_allocations(comp) == hardware_allocations(fabrics) and quarantines(comp) == []
        comp.recompose(c.id, remove=[alloc.id])
        assert hardware_allocations(fabrics) == {} and comp.get(c.id).allocations == ()

    def test_a_change_that_added_reports_the_removal_left(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fabrics, comp, c = with_memory()
        alloc = c.allocations[0]
        silence = Silenced(fabrics, "cxl0", monkeypatch)
        change = comp.recompose_steps(c.id, add=[parse_resource("nic")], remove=[alloc.id])
        with pytest.raises(DisaggError) as failed:
            steps.run(before_first_call(change, silence), comp.store)
        assert failed.value.metadata == {"composition": c.id, "bound": alloc.id}
        kept = comp.get(c.id)
        assert len(kept.devices) == 2 and [a.id for a in kept.allocations] == [alloc.id]
        silence.answer(comp)
        assert ledger_bindings(comp) == hardware_bindings(fabrics)
        assert ledger_allocations(comp) == hardware_allocations(fabrics) and quarantines(comp) == []

    def test_a_decompose_keeps_the_memory_it_could_not_release(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fabrics, comp, c = with_memory()
        alloc = c.allocations[0]
        silence = Silenced(fabrics, "cxl0", monkeypatch)
        with pytest.raises(DisaggError, match=f"decompose of {c.id} left {alloc.id} bound") as failed:
            steps.run(before_first_call(comp.decompose_steps(c.id), silence), comp.store)
        assert failed.value.metadata["bound"] == alloc.id
        kept = comp.get(c.id)
        assert kept.state is CompositionState.UNKNOWN
        assert kept.devices == () and [a.id for a in kept.allocations] == [alloc.id]
        assert hardware_bindings(fabrics) == {} and held(fabrics, alloc)
        silence.answer(comp)
        assert comp.get(c.id).state is CompositionState.FAILED and quarantines(comp) == []
        comp.decompose(c.id)
        assert comp.compositions() == [] and hardware_allocations(fabrics) == {}

    def test_a_heal_keeps_the_failed_device_it_could_not_unbind(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert c is not None
        failed_gpu = c.device_ids[0]
        fabrics["pcie0"].fail_device(failed_gpu)
        silence = Silenced(fabrics, "pcie0", monkeypatch)
        pcie = fabrics["pcie0"]
        real_bind = pcie.bind

        def bind_then_go_silent(device: str, host: str, ctx: CallContext) -> Binding:
            bound: Binding = real_bind(device, host, ctx)
            silence()
            return bound

        monkeypatch.setattr(pcie, "bind", bind_then_go_silent)
        with pytest.raises(DisaggError, match=f"could not unbind {failed_gpu} from h1"):
            comp.heal(c.id)
        kept = comp.get(c.id)
        assert failed_gpu in kept.device_ids and kept.state is CompositionState.UNKNOWN
        assert hardware_bindings(fabrics)[failed_gpu] == "h1"
        silence.answer(comp)
        assert ledger_bindings(comp) == hardware_bindings(fabrics)


class VanishingPool(SimFabric):
    """A sim fabric whose pool ``gone`` (and the device behind it) it no longer has: its DCD was removed."""

    gone: str | None = None

    def discover(self) -> Topology:
        topology = super().discover()
        pool = next((p for p in topology.pools if p.id == self.gone), None)
        if pool is None:
            return topology
        return attrs.evolve(
            topology,
            pools=tuple(p for p in topology.pools if p is not pool),
            devices=tuple(d for d in topology.devices if d.id != pool.device),
        )

    def pool(self, pool: str) -> SimPool:
        if pool == self.gone:
            raise NotFoundError("pool", pool, f"fabric {self.name!r} has no pool {pool!r}")
        return super().pool(pool)


class TestAPoolThatIsGone:
    def test_a_decompose_counts_its_memory_released(self) -> None:
        """A fabric that answers and has no such pool any more holds nothing carved from it: a decompose left the
        composition FAILED with that memory "still bound", and no retry could end it, its host and name taken."""
        fabrics = rack()
        fabrics["cxl0"] = cxl = VanishingPool(load_topology("cxl0", "demo-cxl"))
        comp = composer(fabrics, auto_heal=False)
        job = comp.compose(parse_request("job", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert job is not None
        cxl.gone = job.allocations[0].pool
        cxl.set_link("h4", "cxl-top", False)  # an event: the composer discovers again, without the pool
        assert comp.get(job.id).state is CompositionState.DEGRADED
        comp.decompose(job.id)
        assert comp.compositions() == [] and hardware_bindings(fabrics) == {}
        assert comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition is not None


class LeavesOut(Plain):
    """A driver whose discovery leaves out the pool ``left_out``, which it still has (cxl-switch does, while a
    failed MLD has not given its geometry)."""

    left_out: str | None = None

    def discover(self) -> Topology:
        topology = self.inner.discover()
        return attrs.evolve(topology, pools=tuple(p for p in topology.pools if p.id != self.left_out))


class TestAPoolDiscoveryLeavesOut:
    def test_a_remote_release_is_the_drivers_to_answer(self) -> None:
        """The remote fabric answered "no such pool" itself, from discovery, and the decompose counted memory the
        driver still held as released: the ledger forgot it while the host kept it."""
        sim = create_fabric("cxl0", {"topology": "demo-cxl"})
        driver = LeavesOut(sim)
        server = DriverServer(driver, "127.0.0.1:0", driver="sim").start()
        remote = RemoteFabric("cxl0", server.address, connect_timeout_s=5)
        try:
            comp = composer({"cxl0": remote}, auto_heal=False)
            job = comp.compose(parse_request("job", ["cxl-memory 8GiB"])).composition
            assert job is not None
            driver.left_out = job.allocations[0].pool
            sim.set_link("h4", "cxl-top", False)  # an event: the composer discovers again, without the pool
            assert eventually(lambda: comp.get(job.id).state is CompositionState.DEGRADED, 10.0)
            comp.decompose(job.id)
            assert comp.compositions() == [] and hardware_allocations({"cxl0": sim}) == {}
        finally:
            remote.close()
            server.stop(grace=0)


class TestRecomposeRefusal:
    """A recompose that does not fit names the lines of its own ``add`` as the request names them, not by
    their place in the composition."""

    def test_held_by_names_the_added_lines(self) -> None:
        comp = composer(rack())
        comp.compose(parse_request("job", ["host h1", "gpu x2", "nic"]))
        with pytest.raises(NoFitError) as refused:
            comp.recompose("job", add=[parse_resource("gpu x17"), parse_resource("gpu x2")])
        assert "17 of them held by add[0]; no other arrangement" in refused.value.message
        with pytest.raises(NoFitError) as refused:
            comp.recompose("job", add=[parse_resource(f"gpu x{n}") for n in (9, 8, 2)])
        assert "17 of them held by add[0] and add[1];" in refused.value.message
        assert "of this request" not in refused.value.message

    def test_held_memory_names_the_added_lines(self) -> None:
        comp = composer(rack())
        comp.compose(parse_request("job", ["host h1", "gpu x1"]))
        with pytest.raises(NoFitError) as refused:
            comp.recompose("job", add=[parse_resource("cxl-memory 3TiB"), parse_resource("cxl-memory 2TiB")])
        assert "3 TiB of it held by add[0]; no other arrangement" in refused.value.message

    def test_a_line_no_placement_honours_is_named_as_added(self) -> None:
        """It was checked as a request of its own, so every added line was "resource 0", field resources[0]."""
        comp = composer(rack())
        comp.compose(parse_request("job", ["host h1", "gpu x1"]))
        with pytest.raises(InvalidRequestError) as refused:
            comp.recompose("job", add=[parse_resource("nic"), parse_resource("cxl-memory 1GiB same-switch")])
        assert refused.value.field == "add[1]"
        assert refused.value.message.startswith("add[1]: spread and same-switch choose among whole devices")

    def test_compose_still_names_its_lines_by_place(self) -> None:
        comp = composer(rack())
        with pytest.raises(NoFitError) as refused:
            comp.compose(parse_request("job", ["host h1", "cxl-memory 3TiB", "cxl-memory 2TiB"]))
        assert "3 TiB of it held by line 0 of this request;" in refused.value.message


class TestRecomposeEvents:
    """A recompose's CompositionUpdated event counts the devices and the allocations it added or removed."""

    def test_memory_alone(self) -> None:
        comp = composer(rack())
        c = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert c is not None
        grown = comp.recompose(c.id, add=[parse_resource("cxl-memory 1GiB")])
        comp.recompose(c.id, remove=[grown.allocations[0].id])
        assert updates(comp, c.id) == ["added 1 allocation", "removed 1 allocation"]

    def test_devices_and_memory(self) -> None:
        comp = composer(rack())
        c = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert c is not None
        grown = comp.recompose(c.id, add=[parse_resource("gpu x2"), parse_resource("cxl-memory 1GiB")])
        comp.recompose(c.id, add=[parse_resource("nic")])
        comp.recompose(c.id, remove=[*grown.device_ids[1:3], grown.allocations[0].id])
        assert updates(comp, c.id) == [
            "added 2 devices and 1 allocation",
            "added 1 device",
            "removed 2 devices and 1 allocation",
        ]


def updates(comp: FabricComposer, comp_id: str) -> list[str]:
    return [e.message for e in comp.events() if e.type is EventType.COMPOSITION_UPDATED and e.subject == comp_id]


class TestEmptyEtag:
    """An empty etag is refused by the Python API: no etag is empty, and None is how to ask for no guard."""

    def test_recompose_refuses_it_and_changes_nothing(self) -> None:
        comp = composer(rack())
        c = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert c is not None
        revision = comp.revision
        with pytest.raises(InvalidRequestError, match="an etag is never empty") as refused:
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag="")
        assert refused.value.field == "expected_etag"
        with pytest.raises(InvalidRequestError, match="an etag is never empty"):
            steps.run(comp.recompose_steps(c.id, add=[parse_resource("nic")], expected_etag=""), comp.store)
        assert comp.get(c.id) == c and comp.revision == revision
        assert len(comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=None).devices) == 2


def one_gpu(fabrics: dict[str, SimFabric] | None = None, **kwargs: object) -> tuple[FabricComposer, Composition]:
    comp = composer(fabrics if fabrics is not None else rack(), auto_heal=False, **kwargs)
    c = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
    assert c is not None
    return comp, c


class TestARecomposeRolledBackCompletely:
    """A recompose whose binds fail and are all undone leaves the composition as it was, and the etag it had
    before the change guards an update again: the retry of that change (UNAVAILABLE invites one, with the same
    request id and etag), or another client's change read before it. It was refused as stale, the record having
    been rewritten on the way (COMPOSING, then back). An etag read while the change ran is never valid again."""

    def test_its_retry_with_the_same_request_id_and_etag_runs(self) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics)
        fabrics["pcie0"].flaky_bind(None, 1)
        nic = [parse_resource("nic")]
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1")
        assert comp.get(c.id).device_ids == c.device_ids
        grown = comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1")
        assert len(grown.devices) == 2 and set(hardware_bindings(fabrics)) == set(grown.device_ids)
        assert comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1") == grown

    def test_another_client_holding_the_etag_read_before_may_change_it(self) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics)
        fabrics["pcie0"].flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag)
        assert len(comp.recompose(c.id, add=[parse_resource("nvme")], expected_etag=c.etag).devices) == 2

    def test_so_may_the_reader_of_the_record_it_left_and_each_retry_that_fails_again(self) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics)
        fabrics["pcie0"].flaky_bind(None, 2)
        nic = [parse_resource("nic")]
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1")
        left = comp.get(c.id)
        assert left.generation > c.generation  # the generation a client sees never goes back
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1")
        comp.recompose(c.id, add=nic, expected_etag=left.etag)
        with pytest.raises(ConflictError):
            comp.recompose(c.id, add=nic, expected_etag=c.etag, request_id="r1")

    def test_an_etag_read_while_the_change_ran_is_refused(self) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics)
        fabrics["pcie0"].flaky_bind(None, 1)
        seen: list[Composition] = []
        change = comp.recompose_steps(c.id, add=[parse_resource("nic")], expected_etag=c.etag)
        with pytest.raises(FabricUnavailableError):
            steps.run(before_first_call(change, lambda: seen.append(comp.get(c.id))), comp.store)
        assert seen[0].state is CompositionState.COMPOSING
        with pytest.raises(ConflictError, match="not " + re.escape(seen[0].etag)):
            comp.recompose(c.id, add=[parse_resource("nvme")], expected_etag=seen[0].etag)
        comp.recompose(c.id, add=[parse_resource("nvme")])
        for stale in (seen[0].etag, c.etag):
            with pytest.raises(ConflictError):
                comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=stale)

    def test_one_that_left_the_composition_otherwise_keeps_no_old_etag(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A device failed while the change ran: the composition came back DEGRADED, which is not as it was."""
        fabrics = rack()
        comp, c = one_gpu(fabrics)

        def bind(device: str, host: str, ctx: CallContext) -> None:
            fabrics["pcie0"].fail_device(c.device_ids[0])
            eventually(lambda: comp.device(c.device_ids[0]).health is not Health.OK)
            raise FabricUnavailableError("switch busy")

        monkeypatch.setattr(fabrics["pcie0"], "bind", bind)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag, request_id="r1")
        assert comp.get(c.id).state is CompositionState.DEGRADED
        monkeypatch.undo()
        with pytest.raises(ConflictError):
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag, request_id="r1")

    def test_the_etag_before_it_holds_after_a_restart(self, tmp_path: Path) -> None:
        states = {name: {"state_file": tmp_path / f"{name}.json"} for name in ("pcie0", "cxl0")}
        fabrics = rack(**states)
        first, c = one_gpu(fabrics, store=SqliteStore(tmp_path / "ledger.db"))
        fabrics["pcie0"].flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError):
            first.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag, request_id="r1")
        first.close()
        for fabric in fabrics.values():
            fabric.close()
        again = composer(rack(**states), store=SqliteStore(tmp_path / "ledger.db"))
        try:
            grown = again.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag, request_id="r1")
            assert len(grown.devices) == 2
        finally:
            again.close()

    @staticmethod
    def _unbind_refused_once(fabric: SimFabric, monkeypatch: pytest.MonkeyPatch) -> None:
        def unbind(binding: Binding, ctx: CallContext) -> None:
            monkeypatch.undo()
            raise FabricUnavailableError("the switch does not answer")

        monkeypatch.setattr(fabric, "unbind", unbind)

    @staticmethod
    def _without_a_replacement(fabrics: dict[str, SimFabric]) -> tuple[FabricComposer, Composition]:
        """A composition DEGRADED with the heal's "no replacement" after its reason."""
        comp = composer(fabrics)
        c = comp.compose(parse_request("all-a", ["host h1", "gpu x10 model=H200 same-switch"])).composition
        assert c is not None
        fabrics["pcie0"].fail_device(c.device_ids[3])
        assert comp.wait_for_heals(10.0)
        stuck = comp.get(c.id)
        assert stuck.state is CompositionState.DEGRADED and "no replacement" in stuck.message
        return comp, stuck

    def test_so_does_a_removal_that_removed_nothing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Its driver refused the unbind and the composition kept the device, as it was: "remove it again"."""
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert c is not None
        self._unbind_refused_once(fabrics["pcie0"], monkeypatch)
        gone = [c.device_ids[0]]
        with pytest.raises(DisaggError, match="could not remove"):
            comp.recompose(c.id, remove=gone, expected_etag=c.etag, request_id="r1")
        assert comp.get(c.id).device_ids == c.device_ids
        assert comp.recompose(c.id, remove=gone, expected_etag=c.etag, request_id="r1").device_ids == c.device_ids[1:]

    def test_so_does_one_whose_heal_found_no_replacement(self) -> None:
        """DEGRADED with the heal's "no replacement" after its reason: the rollback wrote the reason alone, a message
        the composition did not have before, and the retry was refused as stale."""
        fabrics = rack()
        comp, stuck = self._without_a_replacement(fabrics)
        fabrics["pcie0"].flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(stuck.id, add=[parse_resource("nic")], expected_etag=stuck.etag, request_id="r1")
        assert (comp.get(stuck.id).state, comp.get(stuck.id).message) == (stuck.state, stuck.message)
        grown = comp.recompose(stuck.id, add=[parse_resource("nic")], expected_etag=stuck.etag, request_id="r1")
        assert len(grown.devices) == len(stuck.devices) + 1

    def test_so_does_a_removal_that_removed_nothing_from_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The same for a removal whose unbind failed: it wrote the reason alone too."""
        fabrics = rack()
        comp, stuck = self._without_a_replacement(fabrics)
        self._unbind_refused_once(fabrics["pcie0"], monkeypatch)
        gone = [stuck.device_ids[0]]
        with pytest.raises(DisaggError, match="could not remove"):
            comp.recompose(stuck.id, remove=gone, expected_etag=stuck.etag, request_id="r1")
        after = comp.get(stuck.id)
        assert (after.device_ids, after.state, after.message) == (stuck.device_ids, stuck.state, stuck.message)
        retried = comp.recompose(stuck.id, remove=gone, expected_etag=stuck.etag, request_id="r1")
        assert retried.device_ids == stuck.device_ids[1:]


class TestTheLedgerARollbackLeaves:
    """The fields that keep a rolled-back change's etags (`equivalent_generations`, a pending addition's
    `generations_before`) are written only when set: the release before knew neither, and refuses a record that
    names a field it does not know, so a ledger in which no change was ever undone must stay one it reads (a
    replica not yet upgraded may lead during a rolling upgrade)."""

    @staticmethod
    def _records(path: Path) -> str:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return "\n".join(row[0] for row in db.execute("SELECT doc FROM compositions"))

    def test_none_is_written_while_no_change_was_undone(self, tmp_path: Path) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics, store=SqliteStore(tmp_path / "l.db"))
        grown = comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag)
        comp.recompose(grown.id, remove=[grown.device_ids[-1]], expected_etag=grown.etag)
        comp.close()
        text = self._records(tmp_path / "l.db")
        assert '"generation"' in text
        assert "equivalent_generations" not in text and "generations_before" not in text

    def test_a_change_undone_writes_them_and_they_load_back(self, tmp_path: Path) -> None:
        fabrics = rack()
        comp, c = one_gpu(fabrics, store=SqliteStore(tmp_path / "l.db"))
        fabrics["pcie0"].flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag)
        comp.close()
        assert "equivalent_generations" in self._records(tmp_path / "l.db")
        again = composer(fabrics, store=SqliteStore(tmp_path / "l.db"), auto_heal=False)
        try:
            assert again.get(c.id).holds_etag(c.etag)
        finally:
            again.close()
