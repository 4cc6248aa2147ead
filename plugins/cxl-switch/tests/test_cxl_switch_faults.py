"""The driver against a switch that misbehaves (an answer lost, held back or malformed, a background operation that
never ends) and against calls that race a newer fencing epoch. A lost answer to a command that changes the switch
must say its outcome is unknown, so that the composer's rollback undoes the call too; only SDK errors leave."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cxl_switch_served import Clock, Respond, ServedSwitch, command_of, truncated
from cxl_switch_wire import ld_units
from disagg.composer.execution import in_doubt
from disagg.errors import (
    OUTCOME,
    CapacityExhaustedError,
    DeadlineExceededError,
    DeviceBusyError,
    DisaggError,
    FabricUnavailableError,
    StaleEpochError,
)
from disagg.interfaces import CallContext, Pool
from disagg.model import Binding, PoolKind
from disagg_cxl_switch import CCIMessage
from disagg_cxl_switch.driver import CxlSwitchFabric, client, create_fabric
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.background import BACKGROUND_OPERATION_STATUS
from disagg_cxl_switch.emulator.state import GIB
from disagg_cxl_switch.emulator.vendor import InjectSurpriseRemovalRequest, VendorOpcode
from disagg_cxl_switch.fmapi import Opcode

MIB = 1 << 20
MLD_PORT = 4
WAIT_S = 5.0
BINDING = Binding("f/port2", "h0")


def ctx(epoch: int = 1, timeout: float = 30.0) -> CallContext:
    return CallContext.with_timeout(timeout, epoch=epoch)


class Bench:
    """Served switches (2 hosts; GPUs on ports 2-3, a 4-LD MLD on 4, a one-region DCD on 5) and fabrics on them."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._served: list[ServedSwitch] = []
        self._fabrics: list[CxlSwitchFabric] = []

    def serve(
        self, respond: Respond | None = None, *, clock: Callable[[], float] = time.monotonic, vppbs: int | None = None
    ) -> ServedSwitch:
        state = default_topology(gpus=2, ld_count=4, mld_capacity=4 * GIB, dc_capacity=GIB, dc_regions=1)
        for vcs in state.vcss if vppbs is not None else ():
            del vcs.vppbs[vppbs:]
        served = ServedSwitch(Switch(state, bind_delay=0.0, clock=clock), self._folder / f"s{len(self._served)}")
        served.respond = respond
        self._served.append(served)
        return served

    def fabric(self, served: ServedSwitch) -> CxlSwitchFabric:
        fabric = create_fabric("f", {"address": served.address, "gpus": 2})
        self._fabrics.append(fabric)
        return fabric

    def close(self) -> None:
        for fabric in self._fabrics:
            with contextlib.suppress(DisaggError):
                fabric.close()
        for served in self._served:
            served.close()


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    made = Bench(tmp_path)
    yield made
    made.close()


def pool_of(fabric: CxlSwitchFabric, kind: PoolKind) -> Pool:
    (info,) = [p for p in fabric.discover().pools if p.kind is kind]
    return fabric.pool(info.id)


def lose_first(opcode: int) -> Respond:
    """Close the connection instead of answering the first request about ``opcode``, after the switch acted."""
    armed = threading.Event()
    armed.set()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage | None:
        if command_of(request) == opcode and armed.is_set():
            armed.clear()
            return None
        return response

    return respond


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "the switch never got there"
        time.sleep(0.01)


Act = Callable[[CxlSwitchFabric], object]


def bind(fabric: CxlSwitchFabric) -> object:
    return fabric.bind("f/port2", "h0", ctx())


def unbind(fabric: CxlSwitchFabric) -> object:
    fabric.unbind(BINDING, ctx())
    return None


def dcd_allocate(fabric: CxlSwitchFabric) -> object:
    return pool_of(fabric, PoolKind.DCD).allocate("a", "h0", 2 * MIB, ctx())


def mld_allocate(fabric: CxlSwitchFabric) -> object:
    return pool_of(fabric, PoolKind.MLD).allocate("a", "h0", 256 * MIB, ctx())


def allocation_ids(fabric: CxlSwitchFabric, kind: PoolKind) -> list[str]:
    return [a.id for a in pool_of(fabric, kind).allocations()]


class TestOutcomeUnknown:
    """After a command that changes the switch may have reached it, a failure says the outcome is unknown."""

    @pytest.mark.parametrize(
        ("opcode", "act", "done"),
        [
            (Opcode.BIND_VPPB, bind, lambda f: f.bindings() == [BINDING]),
            (Opcode.UNBIND_VPPB, unbind, lambda f: f.bindings() == []),
            (Opcode.INITIATE_DC_ADD, dcd_allocate, lambda f: allocation_ids(f, PoolKind.DCD) == ["a"]),
            (Opcode.BIND_VPPB, mld_allocate, lambda f: allocation_ids(f, PoolKind.MLD) == ["a"]),
        ],
        ids=["bind", "unbind", "dcd-allocate", "mld-allocate"],
    )
    def test_a_lost_answer_after_the_switch_acted(
        self, bench: Bench, opcode: Opcode, act: Act, done: Callable[[CxlSwitchFabric], bool]
    ) -> None:
        served = bench.serve()
        fabric = bench.fabric(served)
        if act is unbind:
            bind(fabric)
        served.respond = lose_first(opcode)
        with pytest.raises(FabricUnavailableError) as raised:
            act(fabric)
        assert in_doubt(raised.value)
        assert done(fabric)  # it did happen: the rollback must undo it

    @pytest.mark.parametrize(
        ("opcode", "act"),
        [(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, bind), (Opcode.GET_DC_REGION_EXTENT_LISTS, dcd_allocate)],
        ids=["bind", "dcd-allocate"],
    )
    def test_a_lost_answer_to_a_query_changed_nothing(self, bench: Bench, opcode: Opcode, act: Act) -> None:
        fabric = bench.fabric(bench.serve(lose_first(opcode)))
        with pytest.raises(FabricUnavailableError) as raised:
            act(fabric)
        assert OUTCOME not in raised.value.metadata and not in_doubt(raised.value)
        assert fabric.bindings() == [] and allocation_ids(fabric, PoolKind.DCD) == []

    def test_the_deadline_passes_while_the_answer_is_held(self, bench: Bench) -> None:
        release = threading.Event()

        def hold(request: CCIMessage, response: CCIMessage) -> CCIMessage | None:
            if request.opcode == Opcode.BIND_VPPB:
                release.wait(WAIT_S)
            return response

        fabric = bench.fabric(bench.serve(hold))
        try:
            with pytest.raises(DeadlineExceededError) as raised:
                fabric.bind("f/port2", "h0", ctx(timeout=0.3))
        finally:
            release.set()
        assert in_doubt(raised.value)
        assert fabric.bindings() == [BINDING]

    def test_the_deadline_passes_while_the_bind_runs(self, bench: Bench) -> None:
        clock = Clock()
        served = bench.serve(clock=clock)
        fabric = bench.fabric(served)
        served.switch.bind_delay = 1.0  # on a stopped clock: running until the test moves it
        with pytest.raises(DeadlineExceededError) as raised:
            fabric.bind("f/port2", "h0", ctx(timeout=0.3))
        assert in_doubt(raised.value)
        clock.now = 10.0
        wait_until(lambda: fabric.bindings() == [BINDING])


class TestUnbindDuringBind:
    """A bind whose deadline passed (outcome unknown) still runs on the switch; the rollback's unbind waits for it
    and then unbinds, and never says the device is unbound while that bind may still land."""

    def stuck_bind(self, bench: Bench) -> tuple[ServedSwitch, Clock, CxlSwitchFabric]:
        clock = Clock()
        served = bench.serve(clock=clock)
        fabric = bench.fabric(served)
        served.switch.bind_delay = 1.0  # on a stopped clock: running until the test moves it
        with pytest.raises(DeadlineExceededError) as raised:
            bind_within(fabric, 0.2)
        assert in_doubt(raised.value)
        return served, clock, fabric

    def test_the_unbind_waits_for_the_bind(self, bench: Bench) -> None:
        served, clock, fabric = self.stuck_bind(bench)
        worker, raised = unbind_in_thread(fabric)
        worker.join(0.3)
        waited = worker.is_alive()
        served.switch.bind_delay = 0.0  # the unbind's own Unbind vPPB finishes at once
        clock.now = 10.0  # the bind lands
        worker.join(WAIT_S)
        assert waited, "the unbind returned while the bind still ran"
        assert not worker.is_alive() and raised == []
        assert fabric.bindings() == []

    def test_past_its_deadline_the_unbind_is_retryable(self, bench: Bench) -> None:
        _, clock, fabric = self.stuck_bind(bench)
        with pytest.raises(FabricUnavailableError, match="still runs") as raised:
            fabric.unbind(BINDING, ctx(timeout=0.3))
        assert raised.value.retryable and not in_doubt(raised.value)
        clock.now = 10.0
        wait_until(lambda: fabric.bindings() == [BINDING])  # it did land: success would have leaked it

    def test_a_deadline_that_passes_while_it_reads_again_is_retryable(self, bench: Bench) -> None:
        """The deadline passed during a later read of the switch, on a loaded machine: the unbind raised the
        read's DeadlineExceededError, though it had seen the bind still running and sent nothing."""
        served, clock, fabric = self.stuck_bind(bench)
        reads = itertools.count()

        def slow_after_the_first(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) == Opcode.GET_VIRTUAL_CXL_SWITCH_INFO and next(reads) >= 1:
                time.sleep(0.4)  # past the unbind's 0.3 s deadline
            return response

        served.respond = slow_after_the_first
        with pytest.raises(FabricUnavailableError, match="still runs") as raised:
            fabric.unbind(BINDING, ctx(timeout=0.3))
        assert raised.value.retryable and not in_doubt(raised.value)
        served.respond = None
        clock.now = 10.0
        wait_until(lambda: fabric.bindings() == [BINDING])


def unbind_in_thread(fabric: CxlSwitchFabric) -> tuple[threading.Thread, list[Exception]]:
    """The composer's rollback of `BINDING` (no deadline), started on a thread; the list gets what it raises."""
    raised: list[Exception] = []

    def rollback() -> None:
        try:
            fabric.unbind(BINDING, CallContext(epoch=1))
        except Exception as exc:
            raised.append(exc)

    worker = threading.Thread(target=rollback, daemon=True)
    worker.start()
    return worker, raised


def bind_within(fabric: CxlSwitchFabric, timeout: float) -> object:
    return fabric.bind("f/port2", "h0", ctx(timeout=timeout))


class TestFailedPoolDevice:
    """With a pool's device failed or pulled, its pool answers the contract's errors: FabricUnavailableError
    (retryable) for reads and releases, DeviceBusyError for a carve; never the plugin's own error, nor
    InvalidRequestError, which release keeps for a caller's bad id."""

    @pytest.mark.parametrize("kind", [PoolKind.DCD, PoolKind.MLD], ids=["dcd", "mld"])
    @pytest.mark.parametrize("fault", ["link-down", "pulled"])
    def test_the_pool_answers_the_contract(self, bench: Bench, kind: PoolKind, fault: str) -> None:
        served = bench.serve()
        fabric = bench.fabric(served)
        pool = pool_of(fabric, kind)
        pool.allocate("a", "h0", 256 * MIB, ctx())
        device = pool.info().device
        if fault == "link-down":
            fabric.fail_device(device)
        else:
            port = fabric.view.port_of[device]
            fabric.client.call(VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(port))
        for act in (pool.allocations, lambda: pool.release("a", ctx())):
            with pytest.raises(FabricUnavailableError) as raised:
                act()
            assert raised.value.retryable
        with pytest.raises(DeviceBusyError):
            pool.allocate("b", "h1", 256 * MIB, ctx())


class TestInjectedBindFailure:
    """A bind armed to fail (`flaky_bind`) is a known refusal, whatever becomes of Inject Bind Failure: nothing is
    bound, so the error does not say the outcome is unknown."""

    @pytest.mark.parametrize("act", [bind, mld_allocate], ids=["bind", "mld-allocate"])
    def test_a_lost_answer_to_inject_bind_failure(self, bench: Bench, act: Act) -> None:
        served = bench.serve()
        fabric = bench.fabric(served)
        before = ld_units(served.address, MLD_PORT)
        fabric.flaky_bind(None, 1)
        served.respond = lose_first(VendorOpcode.INJECT_BIND_FAILURE)
        with pytest.raises(FabricUnavailableError) as raised:
            act(fabric)
        assert not in_doubt(raised.value)
        assert fabric.bindings() == [] and allocation_ids(fabric, PoolKind.MLD) == []
        assert ld_units(served.address, MLD_PORT) == before


class TestBackgroundBound:
    def test_a_background_operation_that_never_finishes(self, bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
        """A rollback's unbind carries no deadline; the wait for its Unbind vPPB still ends, outcome unknown,
        and lets the bind lock go."""
        monkeypatch.setattr(client, "BACKGROUND_TIMEOUT_S", 0.3)
        clock = Clock()
        served = bench.serve(clock=clock)
        fabric = bench.fabric(served)
        bind(fabric)
        served.switch.bind_delay = 1.0
        worker, raised = unbind_in_thread(fabric)
        worker.join(WAIT_S)
        hung = worker.is_alive()
        clock.now = 10.0  # let a hung wait end, whatever the outcome
        worker.join(WAIT_S)
        assert not hung, "the wait for a background operation never ended"
        (error,) = raised
        assert isinstance(error, FabricUnavailableError) and in_doubt(error)
        assert fabric.vppb_lock.acquire(timeout=0)
        fabric.vppb_lock.release()


class TestMalformedResponse:
    """A response the switch got wrong is `FabricUnavailableError`, never the wire layer's own error."""

    @pytest.mark.parametrize(
        ("opcode", "act"),
        [
            (Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, lambda f: f.bindings()),
            (Opcode.GET_PHYSICAL_PORT_STATE, lambda f: f.discover()),
            (BACKGROUND_OPERATION_STATUS, bind),
            (Opcode.GET_LD_ALLOCATIONS, lambda f: f.pool("f/mld-port4").allocations()),
            (Opcode.GET_DC_REGION_EXTENT_LISTS, lambda f: f.pool("f/dcd-port5").allocations()),
        ],
        ids=["vcs-info", "port-state", "background-status", "ld-allocations", "extent-lists"],
    )
    def test_in_a_call(self, bench: Bench, opcode: int, act: Act) -> None:
        armed = threading.Event()
        fabric = bench.fabric(bench.serve(cut(opcode, armed)))
        armed.set()
        with pytest.raises(FabricUnavailableError, match="malformed"):
            act(fabric)

    @pytest.mark.parametrize(
        "opcode",
        [
            Opcode.IDENTIFY_SWITCH_DEVICE,
            Opcode.GET_LD_INFO,
            Opcode.GET_HOST_DC_REGION_CONFIG,
            VendorOpcode.GET_EVENT_RECORDS,
        ],
        ids=["identify", "ld-info", "dc-region-config", "event-records"],
    )
    def test_when_the_driver_starts(self, bench: Bench, opcode: int) -> None:
        armed = threading.Event()
        armed.set()
        served = bench.serve(cut(opcode, armed))
        with pytest.raises(FabricUnavailableError, match="malformed"):
            bench.fabric(served)


def cut(opcode: int, armed: threading.Event) -> Respond:
    """Cut short every response about ``opcode`` once ``armed``."""

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage | None:
        if armed.is_set() and command_of(request) == opcode:
            return truncated(response, request.opcode == Opcode.TUNNEL_MANAGEMENT_COMMAND)
        return response

    return respond


class TestFencing:
    """A call that passed the fence and then queued for the switch's lock is refused once it holds the lock if a
    newer epoch was seen meanwhile: nothing of a deposed manager lands after its successor took over."""

    @pytest.mark.parametrize(
        ("prepare", "act", "unchanged"),
        [
            (None, bind, lambda f: f.bindings() == []),
            (bind, unbind, lambda f: f.bindings() == [BINDING]),
            (None, dcd_allocate, lambda f: allocation_ids(f, PoolKind.DCD) == []),
            (dcd_allocate, lambda f: release(f, PoolKind.DCD), lambda f: allocation_ids(f, PoolKind.DCD) == ["a"]),
            (None, mld_allocate, lambda f: allocation_ids(f, PoolKind.MLD) == []),
            (mld_allocate, lambda f: release(f, PoolKind.MLD), lambda f: allocation_ids(f, PoolKind.MLD) == ["a"]),
        ],
        ids=["bind", "unbind", "dcd-allocate", "dcd-release", "mld-allocate", "mld-release"],
    )
    def test_a_newer_epoch_seen_while_queued(
        self,
        make_switch: Callable[..., CxlSwitchFabric],
        monkeypatch: pytest.MonkeyPatch,
        prepare: Act | None,
        act: Act,
        unchanged: Callable[[CxlSwitchFabric], bool],
    ) -> None:
        fabric = make_switch(name="f", gpus=2, nvme=0, ld_count=4, mld_capacity_gib=4, dc_capacity_gib=1)
        if prepare is not None:
            prepare(fabric)
        queued, go = threading.Event(), threading.Event()
        original = CallContext.hold

        @contextlib.contextmanager
        def gate(call: CallContext, lock: threading.Lock, what: str) -> Iterator[None]:
            queued.set()
            assert go.wait(WAIT_S)
            with original(call, lock, what):
                yield

        monkeypatch.setattr(CallContext, "hold", gate)
        raised: list[Exception] = []

        def deposed() -> None:
            try:
                act(fabric)
            except Exception as exc:
                raised.append(exc)

        worker = threading.Thread(target=deposed, daemon=True)
        worker.start()
        try:
            assert queued.wait(WAIT_S)
            fabric.unbind(Binding("f/disagg-fence", "disagg-fence"), ctx(epoch=2))  # the successor's fence
        finally:
            go.set()
            worker.join(WAIT_S)
        assert not worker.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], StaleEpochError), raised
        assert unchanged(fabric)


def release(fabric: CxlSwitchFabric, kind: PoolKind) -> object:
    pool_of(fabric, kind).release("a", ctx())
    return None


class TestVPPBs:
    """Each VCS has a vPPB per downstream port and per LD; a switch with fewer says so without a retry."""

    def test_lds_leave_a_vppb_for_every_device(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        fabric = make_switch(name="f", gpus=4, nvme=1, ld_count=4, mld_capacity_gib=4, dc_capacity_gib=0)
        pool = pool_of(fabric, PoolKind.MLD)
        for n in range(4):
            pool.allocate(f"m{n}", "h0", 256 * MIB, ctx())
        devices = [d.id for d in fabric.discover().devices if "pool_kind" not in d.attributes]
        for device in devices:
            fabric.bind(device, "h0", ctx())
        assert sorted(b.device for b in fabric.bindings()) == sorted(devices)

    def test_no_unbound_vppb_is_capacity_exhausted(self, bench: Bench) -> None:
        fabric = bench.fabric(bench.serve(vppbs=1))
        bind(fabric)
        with pytest.raises(CapacityExhaustedError, match="no unbound vPPB") as raised:
            fabric.bind("f/port3", "h0", ctx())
        assert not raised.value.retryable
        assert fabric.bindings() == [BINDING]
