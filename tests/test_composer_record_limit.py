"""Changes that grow a record past what the ledger takes in one (`Store.record_limit`, etcd's transaction) are
refused before anything is bound, not written: a record the ledger cannot take fails it as a whole, which stops
the leader, and the next leader met the same record again.

A compose, and an addition, were measured; a removal (its pending change names what it removes beside all the
composition holds), a reservation's apply (its first record carries the reservation) and a heal (its records
name the failed devices and their replacements) were not. What the composer writes of its own accord into a
record that a change left at the edge (a device's failure while a removal runs, a rollback's failure with the
driver's text) is left out, or said shorter, when the ledger would not take it. In memory, with a small limit
(`LimitedStore`); against etcd, its own limit, in tests/test_etcd_ledger_writes.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from composer_helpers import composer, hardware_bindings, rack
from disagg import codec
from disagg.composer import FabricComposer
from disagg.composer import composer as composer_module
from disagg.errors import (
    ConflictError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    NoFitError,
    RollbackIncompleteError,
    outcome_unknown,
)
from disagg.interfaces import CallContext
from disagg.interfaces.fabric import MAX_ID
from disagg.model import (
    Binding,
    ComposeMode,
    Composition,
    CompositionState,
    Device,
    DeviceKind,
    Event,
    EventType,
    Reservation,
    Topology,
)
from disagg.model.composition import revise
from disagg.model.devices import MAX_FABRIC_NAME
from disagg.requestlang import parse_request, parse_resource
from disagg.store import MemoryStore, RequestRecord
from disagg_sim import SimFabric, load_topology
from disagg_sim.generator import generate_topology


class LimitedStore(MemoryStore):
    """An in-memory ledger that limits a record's size as etcd's does (``limit``, None: none), and keeps what
    it was given past the limit (``oversized``), which etcd's would have failed on, and the size of every
    record it was given (``sizes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.limit: int | None = None
        self.oversized: list[str] = []
        self.sizes: list[int] = []

    @property
    def record_limit(self) -> int | None:
        return self.limit

    def _measure(self, record: Composition | Reservation | RequestRecord | Event) -> None:
        text = codec.record(record)
        self.sizes.append(len(text.encode()))
        if self.limit is not None and len(text.encode()) > self.limit:
            self.oversized.append(text)

    def put_composition(self, composition: Composition) -> None:
        self._measure(composition)
        super().put_composition(composition)

    def put_reservation(self, reservation: Reservation) -> None:
        self._measure(reservation)
        super().put_reservation(reservation)

    def put_request(self, record: RequestRecord) -> None:
        self._measure(record)
        super().put_request(record)

    def append_event(self, event: Event) -> None:
        self._measure(event)
        super().append_event(event)


def size(record: Composition | Reservation) -> int:
    return len(codec.record(record).encode())


MARGIN = 32
"""Bytes a record of one run may differ by from the same of another: its ids are random, a reservation's
expiry a float, whose text is not always as long."""


def largest_written(setup: Callable[[FabricComposer, dict[str, Any]], Any], change: Callable[[Any], object]) -> int:
    """The size of the largest record ``change`` writes, on a composer of its own without a limit, after
    ``setup`` (the composer and its fabrics) made what ``change`` is given, less `MARGIN`: a limit of it has the
    ledger take every other record of it, and not that one."""
    store, fabrics = LimitedStore(), rack()
    comp = composer(fabrics, store=store, auto_heal=False)
    subject = setup(comp, fabrics)
    store.sizes.clear()
    change(subject)
    return max(store.sizes) - MARGIN


def least_taken(store: LimitedStore, change: Callable[[], object]) -> int:
    """The least limit ``store`` takes the records of ``change`` at: the size it is refused with at a limit of one
    byte, refused before it writes anything."""
    store.limit = 1
    with pytest.raises(InvalidRequestError) as refused:
        change()
    found = re.search(r"a record of about (\d+) bytes", refused.value.message)
    assert found is not None
    return int(found[1])


@pytest.fixture
def store() -> LimitedStore:
    return LimitedStore()


def eight_gpus(comp: FabricComposer) -> Composition:
    made = comp.compose(parse_request("job", ["host h1", "gpu x8"]), request_id="r-job").composition
    assert made is not None
    return made


def six_failed(comp: FabricComposer, fabrics: dict[str, Any]) -> tuple[FabricComposer, Composition]:
    job = eight_gpus(comp)
    for device in job.device_ids[:6]:
        fabrics["pcie0"].fail_device(device, "ECC")
    return comp, comp.get(job.id)


class TestAHeal:
    def test_a_heal_whose_records_the_ledger_cannot_take_is_left_undone_saying_why(self, store: LimitedStore) -> None:
        """Nobody asked for it: the composition stays DEGRADED, says why after its reason, with an event, and
        nothing is bound; the ledger goes on."""
        limit = largest_written(six_failed, lambda made: made[0].heal(made[1].id))
        fabrics = rack()
        comp = composer(fabrics, store=store, auto_heal=False)
        _, degraded = six_failed(comp, fabrics)
        assert degraded.state is CompositionState.DEGRADED
        store.limit = limit
        bound = hardware_bindings(fabrics)
        with pytest.raises(NoFitError, match="more than the etcd ledger holds in one record") as refused:
            comp.heal(degraded.id)
        assert store.oversized == [] and store.failure == ""
        assert hardware_bindings(fabrics) == bound and comp.holders() == {d: degraded.id for d in degraded.device_ids}
        now = comp.get(degraded.id)
        assert now.state is CompositionState.DEGRADED and now.pending is None
        assert now.message.startswith(degraded.message)
        assert "record with 6 replacements would be more than" in now.message
        said = [e for e in comp.events(0, 1000) if e.type is EventType.COMPOSITION_UPDATED]
        assert said[-1].message == now.message and said[-1].subject == degraded.id
        assert refused.value.message.startswith(f"cannot heal {degraded.id}: its record")
        assert " bytes, more than" in refused.value.message
        with pytest.raises(NoFitError):
            comp.heal(degraded.id)  # tried again, as every reconcile does: nothing new said
        assert comp.get(degraded.id).generation == now.generation
        store.limit = None
        healed = comp.heal(degraded.id)
        assert healed.state is CompositionState.COMPOSED and not set(degraded.device_ids[:6]) & set(healed.device_ids)


class TestARemoval:
    def test_a_removal_whose_pending_record_the_ledger_cannot_take_is_refused(self, store: LimitedStore) -> None:
        limit = largest_written(
            lambda comp, _: (comp, eight_gpus(comp)),
            lambda m: m[0].recompose(m[1].id, remove=m[1].device_ids[:6], request_id="r-shrink"),
        )
        fabrics = rack()
        comp = composer(fabrics, store=store)
        job = eight_gpus(comp)
        store.limit = limit
        bound = hardware_bindings(fabrics)
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
            comp.recompose(job.id, remove=job.device_ids[:6], request_id="r-shrink")
        assert refused.value.field == "remove" and "remove fewer at a time" in refused.value.message
        assert store.oversized == [] and hardware_bindings(fabrics) == bound
        assert comp.get(job.id) == job and comp.get(job.id).pending is None
        shrunk = comp.recompose(job.id, remove=job.device_ids[:1], request_id="r-one")
        assert shrunk.device_ids == job.device_ids[1:] and store.oversized == []

    def test_an_addition_with_a_removal_whose_record_the_ledger_cannot_take_is_refused(
        self, store: LimitedStore
    ) -> None:
        """The grown composition with its pending removal is one record: measured without the removal, it fit."""
        more = (parse_resource("gpu x1"),)
        limit = largest_written(
            lambda comp, _: (comp, eight_gpus(comp)),
            lambda m: m[0].recompose(m[1].id, add=more, remove=m[1].device_ids[:7], request_id="r-swap"),
        )
        fabrics = rack()
        comp = composer(fabrics, store=store)
        job = eight_gpus(comp)
        store.limit = limit
        bound = hardware_bindings(fabrics)
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
            comp.recompose(job.id, add=more, remove=job.device_ids[:7], request_id="r-swap")
        assert refused.value.field == "add"
        assert store.oversized == [] and hardware_bindings(fabrics) == bound and comp.get(job.id) == job


class TestAnAddition:
    def test_an_addition_the_ledger_cannot_take_is_refused_naming_the_field_add(self, store: LimitedStore) -> None:
        """A Recompose's lines are its field ``add``: the refusal named ``resources``, which it has not."""
        more = (parse_resource("gpu x2"),)
        limit = largest_written(
            lambda comp, _: (comp, eight_gpus(comp)), lambda m: m[0].recompose(m[1].id, add=more, request_id="r-grow")
        )
        fabrics = rack()
        comp = composer(fabrics, store=store)
        job = eight_gpus(comp)
        store.limit = limit
        bound = hardware_bindings(fabrics)
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
            comp.recompose(job.id, add=more, request_id="r-grow")
        assert refused.value.field == "add" and "ask for fewer in one composition" in refused.value.message
        assert store.oversized == [] and hardware_bindings(fabrics) == bound and comp.get(job.id) == job


def reserved(comp: FabricComposer, fabrics: object = None) -> tuple[FabricComposer, Reservation]:
    res = comp.compose(parse_request("job", ["host h1", "gpu x8"]), ComposeMode.RESERVE, request_id="r-res")
    assert res.reservation is not None
    return comp, res.reservation


def applied(made: tuple[FabricComposer, Reservation]) -> Composition:
    """The apply of a reservation `reserved` made, under a request id as long as the reservation's: what a
    reservation measures of its apply's records it measures with its own (the apply's is not known yet)."""
    return made[0].apply_reservation(made[1].id, request_id="r-app")


class TestAnApply:
    def test_a_reservation_whose_apply_the_ledger_cannot_take_is_refused_as_it_is_reserved(
        self, store: LimitedStore
    ) -> None:
        """The apply's first record carries the reservation beside the composition: the reservation and its
        answer fit, its apply never could."""
        store.limit = largest_written(reserved, applied)
        comp = composer(store=store)
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record"):
            reserved(comp)
        assert store.oversized == [] and comp.reservations() == [] and comp.holders() == {}

    def test_an_apply_the_ledger_cannot_take_leaves_the_reservation_standing(self, store: LimitedStore) -> None:
        """Refused, it had let the reservation go first: gone from memory, its devices free, while the ledger
        held it still."""
        limit = largest_written(reserved, applied)
        fabrics = rack()
        comp = composer(fabrics, store=store)
        _, res = reserved(comp)
        store.limit = limit  # lowered since: as a reservation at the edge meets the mark of its apply
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record"):
            applied((comp, res))
        assert store.oversized == [] and hardware_bindings(fabrics) == {}
        assert comp.reservations() == [res] and store.load().reservations == (res,)
        assert comp.holders() == {p.device: res.id for p in res.plan.devices}
        store.limit = None
        made = applied((comp, res))
        assert made.device_ids == tuple(p.device for p in res.plan.devices)


class Down(SimFabric):
    """A generated sim fabric whose management stops answering while ``down`` is set."""

    down = False

    def discover(self) -> Topology:
        if self.down:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")
        return super().discover()

    def bindings(self) -> Sequence[Binding]:
        if self.down:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")
        return super().bindings()


GPUS = 40


def large(store: LimitedStore, step: int = GPUS) -> tuple[FabricComposer, Down, Composition]:
    """A composer on a fabric of a few hundred GPUs, with a composition of `GPUS` of them: composed of ``step``,
    then grown by ``step`` at a time (each addition's pending change names only what it adds); the largest the
    ledger took when it refuses a step."""
    fabric = Down(generate_topology("pcie0", devices=200, gpus_per_chassis=64))
    comp = composer({"pcie0": fabric}, store=store, auto_heal=False)
    made = comp.compose(parse_request("job", ["host d0000-h0", f"gpu x{step}"]), request_id="r-job").composition
    assert made is not None
    more = (parse_resource(f"gpu x{step}"),)
    while len(made.devices) < GPUS:
        try:
            made = comp.recompose(made.id, add=more, request_id=f"r-{len(made.devices)}")
        except InvalidRequestError as error:
            assert "more than the etcd ledger holds" in error.message
            break
    return comp, fabric, made


def lose(fabric: Down, job: Composition, unbound: int, failed: int) -> None:
    """The hardware drops the first ``unbound`` devices of ``job`` behind the composer's back, and the last
    ``failed`` fail (the sim's fault injection, which sends each device's health event)."""
    for device in job.device_ids[:unbound]:
        fabric.unbind(Binding(device, job.host), CallContext(epoch=1 << 40))
    for device in job.device_ids[len(job.device_ids) - failed :]:
        fabric.fail_device(device, "ECC")


class TestWhatTheHardwareReports:
    """A reconcile and a device's failure write what the hardware reports into a composition's record: what it
    no longer holds (`Composition.missing`) and why it is DEGRADED, the state it had before UNKNOWN. Named in
    full, every failed device of a large composition grew its record past what the ledger takes, and failed it."""

    def test_a_large_composition_whose_devices_fail_says_so_in_counts_within_the_limit(
        self, store: LimitedStore
    ) -> None:
        comp, fabric, job = large(store)
        store.limit = size(revise(job, missing=job.device_ids)) + 400
        lose(fabric, job, unbound=20, failed=30)
        comp.reconcile()
        assert store.oversized == [] and store.failure == ""
        now = comp.get(job.id)
        assert now.state is CompositionState.DEGRADED and len(now.missing) == 20
        shown = ", ".join(job.device_ids[:5])
        assert now.message.startswith(f"the hardware no longer holds {shown} and 15 more; unhealthy: ")
        assert now.message.endswith(" and 25 more")
        told = [e for e in comp.events(0, 10_000) if e.type is EventType.DEVICE_HEALTH_CHANGED]
        assert sorted(e.subject for e in told) == sorted(job.device_ids[10:])  # each named in the event log
        comp.reconcile()  # said once: a second pass changes nothing
        assert comp.get(job.id).generation == now.generation

    def test_what_a_reconcile_may_write_fits_in_every_composition_the_ledger_took(self) -> None:
        """A composition is measured as it grows with room for all of it missing and its reasons: at every limit,
        what the ledger took takes every device lost and failed, and its fabric away (UNKNOWN, keeping its
        reason)."""
        first = LimitedStore()
        least = least_taken(first, lambda: large(first, step=4))  # the least its first compose is taken at
        grown = []
        for limit in range(least, least + 5000, 250):
            store = LimitedStore()
            store.limit = limit
            comp, fabric, job = large(store, step=4)
            grown.append(len(job.devices))
            lose(fabric, job, unbound=len(job.devices) // 2, failed=len(job.devices))
            comp.reconcile()
            assert comp.get(job.id).state is CompositionState.DEGRADED
            fabric.down = True
            comp.reconcile()
            assert comp.get(job.id).state is CompositionState.UNKNOWN
            assert store.oversized == [] and store.failure == "", limit
        assert min(grown) < GPUS == max(grown)  # some limits refused an addition


class TestWhatTheComposerSaysOfItsOwnAccord:
    """A record a change left within a few hundred bytes of the limit (a removal's first one names what it
    removes beside all the composition holds; a new composition's, its plan beside its devices) took what the
    composer says of it meanwhile as it came: the reason of a device that failed, a rollback's failure with the
    driver's text (up to 1 KB), and failed the ledger. The state is written still, the words left out or shorter."""

    def test_a_device_that_fails_while_a_removal_unbinds_is_not_said_in_a_record_at_the_edge(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        unlimited = LimitedStore()
        comp, _, job = large(unlimited)
        unlimited.sizes.clear()
        comp.recompose(job.id, remove=job.device_ids[:30], request_id="r-shrink")
        comp, fabric, job = large(store)
        store.limit = max(unlimited.sizes) + MARGIN  # the removal's first record, at the edge: taken
        failing = job.device_ids[-5:]
        unbind, seen = fabric.unbind, []

        def failing_meanwhile(binding: Binding, ctx: CallContext) -> None:
            if not seen:
                now = comp.get(job.id)
                said = revise(now, message=f"unhealthy: {', '.join(failing)}")
                assert now.state is CompositionState.COMPOSING and size(now) <= store.limit < size(said)
                for device in failing:
                    fabric.fail_device(device, "ECC")
                seen.append(comp.get(job.id))
            unbind(binding, ctx)

        monkeypatch.setattr(fabric, "unbind", failing_meanwhile)
        shrunk = comp.recompose(job.id, remove=job.device_ids[:30], request_id="r-shrink")
        assert store.oversized == [] and store.failure == ""
        assert seen[0].state is CompositionState.COMPOSING and seen[0].pending is not None
        told = [e.subject for e in comp.events(0, 10_000) if e.type is EventType.DEVICE_HEALTH_CHANGED]
        assert told == list(failing)  # each named in its own event
        assert shrunk.device_ids == job.device_ids[30:] and shrunk.state is CompositionState.DEGRADED
        assert shrunk.message == f"unhealthy: {', '.join(failing)}"  # said as the change ends, in a smaller record

    def test_a_rollback_that_fails_says_so_without_the_driver_s_text_in_a_record_at_the_edge(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The compose is measured with room for a failure in the driver's longest words (`_failed_as`), and for
        # its fabric set aside for the longest id (`_grown`); this measures it with none, as a record that an
        # older release or a crash left at the edge would be, so that the words do not fit when the failure
        # comes: the write's own fallback is what is tested.
        monkeypatch.setattr(composer_module, "_LONGEST_CLIPPED", "")
        monkeypatch.setattr(composer_module, "_LONGEST_ASIDE", "")
        fabrics = rack()
        comp = composer(fabrics, store=store, auto_heal=False)
        request = parse_request("job", ["host h1", "gpu x8"])
        # the least the compose is taken at: its records at the edge
        store.limit = least_taken(store, lambda: comp.compose(request, request_id="r-job")) + MARGIN
        pcie = fabrics["pcie0"]
        bind, binds = pcie.bind, []
        cause = "the switch stopped answering: " + "the port's firmware logged a fault; " * 40

        def last_bind_fails(device: str, host: str, ctx: CallContext) -> Binding:
            binds.append(device)
            if len(binds) == 8:
                raise FabricUnavailableError(cause)
            return bind(device, host, ctx)

        def unbind_fails(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(pcie, "bind", last_bind_fails)
        monkeypatch.setattr(pcie, "unbind", unbind_fails)
        with pytest.raises(RollbackIncompleteError) as failed:
            comp.compose(request, request_id="r-job")
        assert store.oversized == [] and store.failure == ""
        assert "the port's firmware logged a fault" in failed.value.message  # the caller is told the cause
        now = comp.find("job")
        assert now.state is CompositionState.FAILED and now.pending is not None  # what it left, for a decompose
        listed, more = failed.value.metadata["bound"].split(" and ")  # five of the seven, as the message says
        bound = listed.split(",")
        assert len(set(bound) & set(binds[:7])) == 5 and more == "2 more"
        assert now.message == f"rollback incomplete: {', '.join(bound)} and 2 more still held"
        said = [e for e in comp.events(0, 1000) if e.type is EventType.ROLLBACK_INCOMPLETE]
        assert [e.subject for e in said] == [now.id] and "the port's firmware logged a fault" in said[0].message


class Stuck(SimFabric):
    """A sim fabric whose binds, while ``stuck``, fail with a driver's long message, their outcome unknown, and
    whose unbinds then fail too: a rollback incomplete, told in the driver's own words."""

    stuck = False

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if self.stuck:
            raise outcome_unknown(FabricUnavailableError(f"fabric {self.name}: " + "the switch said no; " * 200))
        return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if self.stuck:
            raise FabricUnavailableError(f"fabric {self.name}: the switch does not answer")
        super().unbind(binding, ctx)


class TestAFailure:
    def test_a_failed_change_in_the_drivers_words_fits_in_a_composition_the_ledger_took(
        self, store: LimitedStore
    ) -> None:
        """A change that fails, its rollback incomplete, writes the driver's text (`TEXT_KEPT` characters of it)
        into the composition's record, which nobody can refuse: a composition is measured with room for it. It
        was measured with room for its parts' reasons only, and a failure's record at the edge failed the ledger."""
        fabric = Stuck(generate_topology("pcie0", devices=200, gpus_per_chassis=64))
        comp = composer({"pcie0": fabric}, store=store, auto_heal=False)
        job = comp.compose(parse_request("job", ["host d0000-h0", "gpu x1"]), request_id="r-job").composition
        assert job is not None
        more = (parse_resource("gpu x1"),)
        store.limit = max(store.sizes) + 200  # every record of the compose fits, and its addition's as it succeeds
        fabric.stuck = True
        bound = hardware_bindings({"pcie0": fabric})
        with pytest.raises(InvalidRequestError, match="more than the etcd ledger holds in one record") as refused:
            comp.recompose(job.id, add=more, request_id="r-grow")
        assert refused.value.field == "add"
        assert store.oversized == [] and store.failure == "" and hardware_bindings({"pcie0": fabric}) == bound
        assert comp.get(job.id) == job
        store.limit = None  # with room for it, it fails as the driver says, its record and answer written
        with pytest.raises(RollbackIncompleteError):
            comp.recompose(job.id, add=more, request_id="r-grow")
        assert comp.get(job.id).state is CompositionState.FAILED


LONGEST_CHARACTER = "\U0001d4b3"
"""A printable character of four bytes in UTF-8: as many as a record writes one in (a backslash takes two)."""


class Borrowing(SimFabric):
    """A demo sim fabric whose discovery also reports ``borrowed`` (ids another fabric may report too)."""

    borrowed: tuple[Device, ...] = ()

    def discover(self) -> Topology:
        topology = super().discover()
        return attrs.evolve(topology, devices=(*topology.devices, *self.borrowed))


def composed_at_the_edge(
    store: LimitedStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[FabricComposer, Borrowing, Borrowing, Composition]:
    """A composition of one GPU on the demo rack of `Borrowing` fabrics, at the least limit its compose is taken
    at. Measured with no room for a failure's driver text (as `TestWhatTheComposerSaysOfItsOwnAccord` does), so
    that what a compose measures of the composition it leaves (`_grown`) decides its size."""
    monkeypatch.setattr(composer_module, "_LONGEST_CLIPPED", "")
    pcie = Borrowing(load_topology("pcie0", "demo-pcie"))
    cxl = Borrowing(load_topology("cxl0", "demo-cxl"))
    comp = composer({"pcie0": pcie, "cxl0": cxl}, store=store, auto_heal=False)
    request = parse_request("gpu", ["host h1", "gpu x1"])
    store.limit = least_taken(store, lambda: comp.compose(request, request_id="r-gpu")) + MARGIN
    made = comp.compose(request, request_id="r-gpu").composition
    assert made is not None
    return comp, pcie, cxl, made


class TestAFabricSetAside:
    def test_a_fabric_set_aside_for_a_long_id_is_said_within_what_the_composition_was_measured_with(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A fabric whose report repeats another's id is set aside and its compositions become UNKNOWN, each
        saying why, the id in it (`MAX_ID` characters, each backslash written as four bytes): a composition was
        measured with room for "fabric pcie0 cannot be reached" only, and a record at the edge failed the ledger."""
        comp, pcie, cxl, made = composed_at_the_edge(store, monkeypatch)
        long_id = "cxl0/" + "\\" * (MAX_ID - 5)
        taken = pcie.discover().devices[0]
        pcie.borrowed = (attrs.evolve(taken, id=long_id),)
        cxl.borrowed = (attrs.evolve(taken, id=long_id, switch="cxl0/cxl-top"),)
        cxl.set_link("h4", "cxl-top", False)  # each event makes the composer discover its fabric again
        pcie.set_link("h4", "top-b", False)
        assert store.oversized == [] and store.failure == ""
        now = comp.get(made.id)
        assert now.state is CompositionState.UNKNOWN
        said = f"it reports device id {long_id!r}, which fabric cxl0 reports too"
        assert now.message == f"fabric pcie0 is set aside: {said}"

    def test_a_fabric_set_aside_by_one_configured_since_is_said_within_what_the_composition_was_measured_with(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The reason names the other fabrics that report the id, one of them configured after the composition was
        measured, its name as long as a fabric's may be written (`MAX_FABRIC_NAME` characters of four bytes each):
        it is said in full, in a record the ledger takes."""
        comp, pcie, cxl, made = composed_at_the_edge(store, monkeypatch)
        comp.close()
        later = LONGEST_CHARACTER * MAX_FABRIC_NAME  # configured since, as long a name as a record writes
        other = Borrowing(load_topology(later, "demo-cxl"))
        comp = composer({"pcie0": pcie, "cxl0": cxl, later: other}, store=store, auto_heal=False)
        long_id = "cxl0/" + "\\" * (MAX_ID - 5)
        taken = pcie.discover().devices[0]
        pcie.borrowed = (attrs.evolve(taken, id=long_id),)
        other.borrowed = (attrs.evolve(taken, id=long_id, switch=f"{later}/cxl-top"),)
        other.set_link("h4", "cxl-top", False)  # each event makes the composer discover its fabric again
        pcie.set_link("h4", "top-b", False)  # the newcomer to the id is set aside
        assert store.oversized == [] and store.failure == ""
        now = comp.get(made.id)
        assert now.state is CompositionState.UNKNOWN
        said = f"it reports device id {long_id!r}, which fabric {later} reports too"
        assert now.message == f"fabric pcie0 is set aside: {said}"

    def test_the_room_for_a_reason_holds_the_names_of_fabrics_configured_later(self) -> None:
        """A composition is measured with room for its fabrics set aside in the longest reason there is
        (`_LONGEST_ASIDE`): it named the fabrics configured then, and those configured later, with longer names
        (`MAX_FABRIC_NAME` characters of four bytes each), gave a longer one."""
        comp = composer(auto_heal=False)
        switch = comp.topologies()[0].switches[0]
        later = [f"{n}{LONGEST_CHARACTER * (MAX_FABRIC_NAME - 1)}" for n in range(7)]
        topologies = [Topology(fabric=f, switches=(attrs.evolve(switch, id="\\" * MAX_ID, fabric=f),)) for f in later]
        given = comp._repeaters(topologies).values()
        assert len(given) == len(later)
        longest = max(composer_module._written_length(why) for why in given)
        assert composer_module._written_length(composer_module._LONGEST_ASIDE) >= longest

    def test_fabrics_set_aside_are_named_with_why_five_at_most(self) -> None:
        aside = [(f"f{n}", f"it reports device id 'f{n}/x', which fabric g reports too") for n in range(7)]
        why = composer_module._away_why(["u0", "u1"], aside, ["gone"])
        assert why.startswith("fabric u0, u1 cannot be reached; fabric f0 is set aside: it reports device id 'f0/x'")
        assert "fabric f4 is set aside" in why and "f5" not in why
        assert why.endswith("; 2 more fabrics are set aside; fabric gone is not loaded (not in the configuration)")


def one_failed(store: LimitedStore) -> tuple[FabricComposer, Any, Composition]:
    """A composer on the demo rack and `eight_gpus`, the first of them failed: what a heal replaces."""
    fabrics = rack()
    comp = composer(fabrics, store=store, auto_heal=False)
    job = eight_gpus(comp)
    fabrics["pcie0"].fail_device(job.device_ids[0], "ECC")
    return comp, fabrics["pcie0"], job


class TestADeviceThatFailsDuringAHeal:
    def test_its_reason_is_not_said_in_a_heal_s_record_at_the_edge(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A heal's records stay DEGRADED, the change in flight in them: a device that failed meanwhile was said
        at once (`_reassess`), unmeasured, in the record that names the failed devices beside their replacements,
        and a longer reason failed the ledger. It is said as the heal ends, in a smaller record."""
        comp, pcie, job = one_failed(store)
        degraded = comp.get(job.id)
        assert degraded.message == f"unhealthy: {job.device_ids[0]}"
        unbind, seen = pcie.unbind, []

        def failing_meanwhile(binding: Binding, ctx: CallContext) -> None:
            if not seen:
                now = comp.get(job.id)
                assert now.state is CompositionState.DEGRADED and now.pending is not None
                store.limit = size(now) + 8  # the heal's largest record, at the edge
                pcie.fail_device(job.device_ids[1], "ECC")
                seen.append(comp.get(job.id))
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "unbind", failing_meanwhile)
        healed = comp.heal(job.id)
        assert store.oversized == [] and store.failure == ""
        assert seen[0].message == degraded.message  # not said in the record at the edge
        told = [e.subject for e in comp.events(0, 10_000) if e.type is EventType.DEVICE_HEALTH_CHANGED]
        assert told == list(job.device_ids[:2])  # each named in its own event
        assert job.device_ids[0] not in healed.device_ids and healed.state is CompositionState.DEGRADED
        assert healed.message == f"unhealthy: {job.device_ids[1]}"  # said as the heal ends
        comp.reconcile()  # said once: a pass writes nothing more
        assert comp.get(job.id).generation == healed.generation

    @pytest.mark.parametrize("room", [64, 8])
    def test_a_heal_that_undoes_a_replacement_says_it_with_the_undo_when_the_ledger_takes_it(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch, room: int
    ) -> None:
        """The failed device cannot be unbound, so its replacement is undone: the record of the undo said the
        reason the heal's records left out only as the undo ended. Said with it when the ledger takes it there
        (``room`` 64); else left out still (8), and said as the undo ends."""
        comp, pcie, job = one_failed(store)
        degraded = comp.get(job.id)
        unbind, seen = pcie.unbind, []
        both = f"unhealthy: {job.device_ids[0]}, {job.device_ids[1]}"

        def stuck_failing_meanwhile(binding: Binding, ctx: CallContext) -> None:
            now = comp.get(job.id)
            seen.append(now)
            if binding.device == job.device_ids[0]:
                store.limit = size(now) + room  # the heal's largest record, at the edge
                pcie.fail_device(job.device_ids[1], "ECC")
                raise FabricUnavailableError("the switch stopped answering")
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "unbind", stuck_failing_meanwhile)
        with pytest.raises(DisaggError, match=f"could not unbind {job.device_ids[0]}"):
            comp.heal(job.id)
        assert store.oversized == [] and store.failure == ""
        heal, undo = seen
        assert heal.message == degraded.message and undo.pending is not None  # longer: not said in the heal's
        assert undo.message == (both if room == 64 else degraded.message)
        now = comp.get(job.id)
        assert now.device_ids == job.device_ids and now.message == both


def interrupted_removal(monkeypatch: pytest.MonkeyPatch) -> tuple[Composition, int]:
    """The first record of a removal of six of `eight_gpus` (it names what it removes beside all the composition
    holds), as a crash would leave it, and the least limit the removal is taken at (its records at the edge):
    taken as the removal unbinds, on a composer of its own."""
    fabrics, store = rack(), LimitedStore()
    comp = composer(fabrics, store=store, auto_heal=False)
    job = eight_gpus(comp)
    store.limit = (
        least_taken(store, lambda: comp.recompose(job.id, remove=job.device_ids[:6], request_id="r-shrink")) + 8
    )
    unbind, seen = fabrics["pcie0"].unbind, []

    def seeing(binding: Binding, ctx: CallContext) -> None:
        seen.append(comp.get(job.id))
        unbind(binding, ctx)

    monkeypatch.setattr(fabrics["pcie0"], "unbind", seeing)
    comp.recompose(job.id, remove=job.device_ids[:6], request_id="r-shrink")
    monkeypatch.undo()
    assert seen[0].state is CompositionState.COMPOSING and seen[0].pending is not None
    return seen[0], store.limit


class TestAnInterruptedChangeOnAFabricAway:
    def test_it_becomes_unknown_in_a_record_the_ledger_takes(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A change a crash interrupted is left to recovery, which waits for its fabric: the record becomes
        UNKNOWN meanwhile, with why and the message it had (before_unknown). Its record may be at the edge (a
        removal's first), and the words failed the ledger; the state is written still, the words shorter."""
        left, store.limit = interrupted_removal(monkeypatch)
        store.put_composition(left)
        pcie = Down(load_topology("pcie0", "demo-pcie"))
        for device in left.device_ids:  # what the hardware holds as the crash left it: all still bound
            pcie.bind(device, left.host, CallContext())
        pcie.down = True
        comp = composer({"pcie0": pcie, "cxl0": rack()["cxl0"]}, store=store, auto_heal=False)
        assert store.oversized == [] and store.failure == ""
        now = comp.get(left.id)
        assert now.state is CompositionState.UNKNOWN and now.pending == left.pending
        assert now.before_unknown is not None and now.before_unknown.state is CompositionState.COMPOSING
        comp.reconcile()  # said once: a pass writes nothing more
        assert comp.get(left.id).generation == now.generation
        pcie.down = False
        assert comp.retry_unreachable() is True  # recovery finishes the removal
        done = comp.get(left.id)
        assert done.state is CompositionState.COMPOSED and done.device_ids == left.device_ids[6:]
        assert store.oversized == [] and store.failure == ""

    def test_its_recovery_that_leaves_parts_bound_fails_it_in_a_record_the_ledger_takes(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Recovery that cannot unbind what a removal a crash interrupted removes makes the record FAILED, the
        change kept for a decompose, saying what is still held: in a record at the edge, the words failed the
        ledger. The state is written still, the words shorter; the event and the log name them."""
        left, store.limit = interrupted_removal(monkeypatch)
        store.put_composition(left)
        pcie = SimFabric(load_topology("pcie0", "demo-pcie"))
        for device in left.device_ids:  # what the hardware holds as the crash left it: all still bound
            pcie.bind(device, left.host, CallContext())

        def unbind_fails(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(pcie, "unbind", unbind_fails)
        comp = composer({"pcie0": pcie, "cxl0": rack()["cxl0"]}, store=store, auto_heal=False)
        assert store.oversized == [] and store.failure == ""
        now = comp.get(left.id)
        assert now.state is CompositionState.FAILED and now.pending == left.pending
        said = [e for e in comp.events(0, 1000) if e.type is EventType.ROLLBACK_INCOMPLETE]
        assert [e.subject for e in said] == [left.id] and left.device_ids[1] in said[0].message
        assert now.message == ""  # at the edge, no room for words: the event names what is held


class TestADecomposeOfAFailedComposition:
    def test_it_is_decomposing_in_a_record_the_ledger_takes(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """FAILED becomes DECOMPOSING, five bytes longer, the message kept: a FAILED record at the edge (as an
        older release, or a limit lowered since, left it) failed the ledger. The state is written still, the
        message left out; the decompose finishes."""
        left, _ = interrupted_removal(monkeypatch)
        store.put_composition(left)
        pcie = SimFabric(load_topology("pcie0", "demo-pcie"))
        for device in left.device_ids:  # what the hardware holds as the crash left it: all still bound
            pcie.bind(device, left.host, CallContext())
        unbind = pcie.unbind

        def unbind_fails(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(pcie, "unbind", unbind_fails)
        comp = composer({"pcie0": pcie, "cxl0": rack()["cxl0"]}, store=store, auto_heal=False)
        failed = comp.get(left.id)
        assert failed.state is CompositionState.FAILED and failed.message.startswith("interrupted change: ")
        store.limit = size(failed) + 2
        monkeypatch.setattr(pcie, "unbind", unbind)
        comp.decompose(failed.id)
        assert store.oversized == [] and store.failure == ""
        assert comp.compositions() == [] and hardware_bindings({"pcie0": pcie}) == {}

    def test_one_without_words_at_the_edge_is_decomposing_in_a_record_the_ledger_takes(
        self, store: LimitedStore
    ) -> None:
        """A FAILED record with no message to leave out, exactly at the limit (an older release's): DECOMPOSING,
        five bytes longer, went past it. The decompose leaves out the request id too, which a composition going
        away needs no more, and finishes."""
        fabrics = rack()
        comp, failed = failed_at_the_edge(fabrics, store, request_id="r-job")
        comp.decompose(failed.id)
        assert store.oversized == [] and store.failure == ""
        assert comp.compositions() == [] and hardware_bindings(fabrics) == {}

    def test_one_whose_release_fails_stays_failed_in_a_record_the_ledger_takes(
        self, store: LimitedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """What it could not release is said in its record when the ledger takes it there, as any other
        message; the error names it."""
        fabrics = rack()
        comp, failed = failed_at_the_edge(fabrics, store, request_id="r-job")

        def unbind_fails(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(fabrics["pcie0"], "unbind", unbind_fails)
        with pytest.raises(DisaggError, match=r"left .* bound; it is FAILED: decompose again") as left:
            comp.decompose(failed.id)
        assert store.oversized == [] and store.failure == ""
        now = comp.get(failed.id)
        assert now.state is CompositionState.FAILED and now.device_ids == failed.device_ids
        assert now.message == ""  # no room at the edge: the error names what is held
        assert left.value.metadata["composition"] == failed.id
        monkeypatch.undo()
        comp.decompose(failed.id)
        assert comp.compositions() == [] and hardware_bindings(fabrics) == {} and store.oversized == []

    def test_one_with_nothing_to_leave_out_is_refused_unchanged(self, store: LimitedStore) -> None:
        """No message nor request id to leave out: the ledger cannot take it DECOMPOSING, and the decompose is
        refused saying so, nothing released or written."""
        fabrics = rack()
        comp, failed = failed_at_the_edge(fabrics, store, request_id="")
        bound = hardware_bindings(fabrics)
        with pytest.raises(ConflictError, match="more than the etcd ledger holds in one record") as refused:
            comp.decompose(failed.id)
        assert f"composition {failed.id} cannot be decomposed" in refused.value.message
        assert store.oversized == [] and store.failure == ""
        assert comp.get(failed.id) == failed and hardware_bindings(fabrics) == bound


def failed_at_the_edge(
    fabrics: dict[str, Any], store: LimitedStore, request_id: str
) -> tuple[FabricComposer, Composition]:
    """A composition of `eight_gpus` that an older release left FAILED without a message, its record exactly at
    the limit, on a composer started from that ledger."""
    made = composer(fabrics, auto_heal=False).compose(
        parse_request("job", ["host h1", "gpu x8"]), request_id=request_id or None
    )
    assert made.composition is not None
    failed = revise(made.composition, state=CompositionState.FAILED, message="")
    store.put_composition(failed)
    comp = composer(fabrics, store=store, auto_heal=False)
    assert comp.get(failed.id).state is CompositionState.FAILED
    store.limit = size(failed)
    return comp, comp.get(failed.id)


BACKSLASHES = "\\" * (MAX_ID - 9)


class StuckUnbinds(SimFabric):
    """The demo PCIe fabric, each GPU's id `MAX_ID` characters long, most of them backslashes (each written as
    four bytes in a request's answer, which is a document within its record); its unbind of a device in
    ``stuck`` fails."""

    def __init__(self) -> None:
        topology = load_topology("pcie0", "demo-pcie")
        devices = tuple(
            attrs.evolve(d, id=f"pcie0/{BACKSLASHES}{n:03d}") if d.kind is DeviceKind.GPU else d
            for n, d in enumerate(topology.devices)
        )
        super().__init__(attrs.evolve(topology, devices=devices))
        self.stuck: set[str] = set()

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if binding.device in self.stuck:
            raise FabricUnavailableError("the switch stopped answering")
        super().unbind(binding, ctx)


class TestARequestsAnswer:
    @pytest.mark.parametrize(("gpus", "removed"), [(16, 15), (6, 5)])
    def test_a_removal_that_left_parts_bound_answers_in_a_record_the_ledger_takes(
        self, store: LimitedStore, gpus: int, removed: int
    ) -> None:
        """Its answer, kept for its retries, named every part left in its metadata beside the first five in its
        message: larger than the records of the removal, which the ledger took at the edge, it failed the ledger.
        It names the first five, then how many more, as the message does (the composition's record names all),
        and a removal is measured with the longest answer it may leave."""
        pcie = StuckUnbinds()
        comp = composer({"pcie0": pcie, "cxl0": rack()["cxl0"]}, store=store, auto_heal=False)
        job = comp.compose(parse_request("job", ["host h1", f"gpu x{gpus}"]), request_id="r-job").composition
        assert job is not None
        remove = job.device_ids[:removed]
        # the least the removal is taken at: its records at the edge
        store.limit = least_taken(store, lambda: comp.recompose(job.id, remove=remove, request_id="r-shrink")) + MARGIN
        pcie.stuck = set(remove[1:])
        with pytest.raises(DisaggError, match="could not remove") as left:
            comp.recompose(job.id, remove=remove, request_id="r-shrink")
        assert store.oversized == [] and store.failure == ""
        now = comp.get(job.id)
        assert now.device_ids == job.device_ids[1:]  # the composition names every part left
        held, _, more = left.value.metadata["bound"].partition(" and ")
        assert len(set(held.split(",")) & set(remove[1:])) == min(5, removed - 1)
        assert more == ("9 more" if removed > 6 else "")
        with pytest.raises(DisaggError) as again:  # its retry gets the answer kept
            comp.recompose(job.id, remove=remove, request_id="r-shrink")
        assert again.value.metadata == left.value.metadata
