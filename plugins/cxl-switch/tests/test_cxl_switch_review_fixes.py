"""The driver where another fabric manager, a wrapped event log or a switch answering beside the question would
have misled it: an MLD carve must not report another amount, nor a rollback free a peer's LD; an answer about
other ids is the fabric failing; a released DCD allocation leaves no name behind; a gap in the event log still
reaches subscribers; an armed bind failure fails no other bind. Served in-process, the peer on its own
connection."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from cxl_switch_client import Client, in_process
from cxl_switch_served import Respond, ServedSwitch, command_of
from cxl_switch_wire import HeldVPPB, held_vppbs, ld_units
from disagg.composer.execution import in_doubt
from disagg.errors import DeviceBusyError, DisaggError, FabricUnavailableError
from disagg.interfaces import CallContext, Pool
from disagg.model import Binding, FabricEvent, Health
from disagg_cxl_switch import CCIMessage
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric
from disagg_cxl_switch.driver.client import CCIClient
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.background import BACKGROUND_OPERATION_STATUS
from disagg_cxl_switch.emulator.state import GIB, MIB
from disagg_cxl_switch.emulator.vendor import (
    GetEventRecordsRequest,
    GetEventRecordsResponse,
    InjectLinkDownRequest,
    VendorOpcode,
)
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    GetPhysicalPortStateResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    LDAllocation,
    Opcode,
    PhysicalPortControlRequest,
    PortOpcode,
    SetLDAllocationsRequest,
    TunnelManagementCommandRequest,
    VPPBBindingStatus,
    VPPBInfo,
)
from disagg_cxl_switch.returncodes import ReturnCode

H0_VCS, H1_VCS = 0, 1
GPU_PORT, OTHER_GPU_PORT, MLD_PORT, DCD_PORT = 2, 3, 4, 5
MLD_POOL, DCD_POOL = f"f/mld-port{MLD_PORT}", f"f/dcd-port{DCD_PORT}"
WAIT_S = 5.0


def ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


class Bench:
    """A served switch (two hosts; GPUs on ports 2-3, a 4-LD 4 GiB MLD on 4, a 1 GiB DCD on 5), the driver's fabric
    on it, and the peer fabric manager's client."""

    def __init__(self, folder: Path, *, event_capacity: int = 256, state_dir: Path | None = None) -> None:
        self._event_capacity = event_capacity
        self.served = ServedSwitch(self._switch(), folder / "s.sock")
        self.peer = CCIClient(self.served.address)
        options: dict[str, object] = {"address": self.served.address, "gpus": 2}
        if state_dir is not None:
            options["state_dir"] = str(state_dir)
        self.fabric: CxlSwitchFabric = create_fabric("f", options)

    def _switch(self) -> Switch:
        state = default_topology(gpus=2, ld_count=4, mld_capacity=4 * GIB, dc_capacity=GIB, dc_regions=1)
        return Switch(state, bind_delay=0.0, event_capacity=self._event_capacity)

    def restart(self) -> None:
        """Serve a new switch in the old one's place, as a restarted emulator: its log numbers from 1 again."""
        self.served.switch = self._switch()

    def pool(self, pool_id: str) -> Pool:
        return self.fabric.pool(pool_id)

    def respond(self, respond: Respond) -> None:
        self.served.respond = respond

    def close(self) -> None:
        with contextlib.suppress(DisaggError):
            self.fabric.close()
        self.peer.close()
        self.served.close()


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    made = Bench(tmp_path)
    yield made
    made.close()


def once(when: Callable[[CCIMessage], bool], act: Callable[[], object]) -> Respond:
    """Let the peer ``act`` once the switch has acted on the first request for which ``when`` holds."""
    armed = threading.Event()
    armed.set()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if armed.is_set() and when(request):
            armed.clear()
            act()
        return response

    return respond


def sets_ld(ld: int) -> Callable[[CCIMessage], bool]:
    """Whether a request is Set LD Allocations (tunnelled) starting at LD ``ld``."""

    def match(request: CCIMessage) -> bool:
        if command_of(request) != Opcode.SET_LD_ALLOCATIONS:
            return False
        inner = TunnelManagementCommandRequest.decode(request.payload).command
        return SetLDAllocationsRequest.decode(inner.payload).start_ld_id == ld

    return match


def peer_sets(bench: Bench, *allocations: tuple[int, int]) -> Callable[[], None]:
    """The peer's Set LD Allocations of each (LD, units), as a manager that picked that LD writes it."""

    def act() -> None:
        for ld, units in allocations:
            request = SetLDAllocationsRequest(ld, (LDAllocation(units, 0),))
            bench.peer.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, request)

    return act


def ld_binds(bench: Bench) -> list[HeldVPPB]:
    return [v for v in held_vppbs(bench.served.address, (H0_VCS, H1_VCS)) if v.port == MLD_PORT]


class TestTwoManagersCarveOneLD:
    """Another manager that picked the same free LD sets it between the driver's Set LD Allocations and its Bind
    vPPB: the driver's allocation is the amount it asked for, or a retryable failure with nothing bound."""

    def test_the_ld_is_set_back_to_the_amount_asked(self, bench: Bench) -> None:
        bench.respond(once(sets_ld(0), peer_sets(bench, (0, 1))))
        allocation = bench.pool(MLD_POOL).allocate("a", "h0", 2 * GIB, ctx())
        assert allocation.amount_bytes == 2 * GIB
        assert ld_units(bench.served.address, MLD_PORT)[0] == 8
        assert [(a.id, a.host, a.amount_bytes) for a in bench.pool(MLD_POOL).allocations()] == [("a", "h0", 2 * GIB)]

    def test_an_ld_the_mld_cannot_set_back_is_unbound_again(self, bench: Bench) -> None:
        """The peer also gave the memory the driver's carve freed to another LD: the LD cannot be set back."""
        bench.respond(once(sets_ld(0), peer_sets(bench, (0, 1), (1, 15))))
        with pytest.raises(FabricUnavailableError, match="another fabric manager") as raised:
            bench.pool(MLD_POOL).allocate("a", "h0", 2 * GIB, ctx())
        assert raised.value.retryable and not in_doubt(raised.value)
        assert ld_binds(bench) == [] and bench.pool(MLD_POOL).allocations() == []

    def test_each_set_ld_allocations_writes_one_ld(self, bench: Bench) -> None:
        """A write of the whole table would put back, on LDs the driver did not carve, what it read before."""
        written: list[tuple[int, int]] = []

        def record(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) == Opcode.SET_LD_ALLOCATIONS:
                inner = TunnelManagementCommandRequest.decode(request.payload).command
                sent = SetLDAllocationsRequest.decode(inner.payload)
                written.append((sent.start_ld_id, len(sent.allocations)))
            return response

        bench.respond(record)
        bench.pool(MLD_POOL).allocate("a", "h0", GIB, ctx())
        assert sorted(written) == [(0, 1), (1, 1), (2, 1), (3, 1)]
        assert ld_units(bench.served.address, MLD_PORT) == [4, 0, 0, 0]


def lose_first_status() -> tuple[Respond, threading.Event]:
    """Close the connection instead of answering the first Background Operation Status once armed."""
    armed = threading.Event()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage | None:
        if armed.is_set() and request.opcode == BACKGROUND_OPERATION_STATUS:
            armed.clear()
            return None
        return response

    return respond, armed


class TestAnLDRecordIsItsVCSs:
    """An LD carve whose bind outcome is unknown keeps its record; a peer that binds that LD to another host since
    holds it: the driver neither lists it under the record's id nor frees it on the id's release."""

    def in_doubt_carve(self, bench: Bench) -> None:
        respond, armed = lose_first_status()
        bench.respond(respond)
        bench.fabric.flaky_bind(f"f/port{MLD_PORT}", 1)  # the bind fails on the switch, nothing bound ...
        armed.set()  # ... and its status is lost
        with pytest.raises(FabricUnavailableError) as raised:
            bench.pool(MLD_POOL).allocate("a", "h0", GIB, ctx())
        assert in_doubt(raised.value)
        assert ld_binds(bench) == []

    def test_a_peers_bind_of_the_ld_is_the_peers(self, bench: Bench) -> None:
        self.in_doubt_carve(bench)
        peer_sets(bench, (0, 2))()
        bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, MLD_PORT, 0))
        pool = bench.pool(MLD_POOL)
        assert [(a.id, a.host) for a in pool.allocations()] == [("ld-0", "h1")]
        pool.release("a", ctx())  # the composer's rollback of the in-doubt allocation
        assert ld_binds(bench) == [HeldVPPB(H1_VCS, VPPBBindingStatus.BOUND_LD, MLD_PORT, 0)]
        assert ld_units(bench.served.address, MLD_PORT)[0] == 2

    def test_an_unbound_ld_of_the_record_is_still_freed(self, bench: Bench) -> None:
        """A carve cut short (nothing bound) holds memory on the LD; the id's release sets it to 0."""
        self.in_doubt_carve(bench)
        assert ld_units(bench.served.address, MLD_PORT)[0] == 4
        bench.pool(MLD_POOL).release("a", ctx())
        assert ld_units(bench.served.address, MLD_PORT)[0] == 0

    def test_records_written_before_vcss_were_kept_are_read(self, tmp_path: Path) -> None:
        """A state file of a driver that kept no VCS: its LD records name the LD whatever VCS holds it, as then."""
        from disagg_cxl_switch.driver.state import DriverState, LDRecord  # here: the other tests run without it

        (tmp_path / "driver-state.json").write_text(json.dumps({"epoch": 3, "lds": {"4/0": "old"}}))
        state = DriverState(tmp_path)
        old = state.ld_record(4, 0)
        assert old == LDRecord("old", None) and old.held_by(7)
        state.name_ld(4, 1, "new", 1)
        new = DriverState(tmp_path).ld_record(4, 1)
        assert new == LDRecord("new", 1) and new.held_by(1) and not new.held_by(0)


def rewrite_vcs_info(change: Callable[[GetVirtualCxlSwitchInfoResponse], GetVirtualCxlSwitchInfoResponse]) -> Respond:
    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode != Opcode.GET_VIRTUAL_CXL_SWITCH_INFO:
            return response
        asked = GetVirtualCxlSwitchInfoRequest.decode(request.payload)
        window = asked.start_vppb, asked.vppb_list_limit
        changed = change(GetVirtualCxlSwitchInfoResponse.decode(response.payload, *window))
        return attrs.evolve(response, payload=changed.encode(*window))

    return respond


def other_vcs_ids(answer: GetVirtualCxlSwitchInfoResponse) -> GetVirtualCxlSwitchInfoResponse:
    return GetVirtualCxlSwitchInfoResponse(tuple(attrs.evolve(v, vcs_id=v.vcs_id + 7) for v in answer.vcss))


def bound_to_ld_9(answer: GetVirtualCxlSwitchInfoResponse) -> GetVirtualCxlSwitchInfoResponse:
    first, *rest = answer.vcss
    entries = (VPPBInfo(VPPBBindingStatus.BOUND_LD, MLD_PORT, 9), *first.vppbs[1:])
    return GetVirtualCxlSwitchInfoResponse((attrs.evolve(first, vppbs=entries), *rest))


def rewrite_port_state(change: Callable[[GetPhysicalPortStateResponse], GetPhysicalPortStateResponse]) -> Respond:
    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode != Opcode.GET_PHYSICAL_PORT_STATE:
            return response
        changed = change(GetPhysicalPortStateResponse.decode(response.payload))
        return attrs.evolve(response, payload=changed.encode())

    return respond


def background_started(request: CCIMessage, response: CCIMessage) -> CCIMessage:
    if request.opcode != BACKGROUND_OPERATION_STATUS:
        return response
    return attrs.evolve(response, return_code=ReturnCode.BACKGROUND_COMMAND_STARTED, payload=b"")


class TestAnswersBesideTheQuestion:
    """An answer that decodes but is not about what was asked is a malformed response: `FabricUnavailableError`,
    never an IndexError, KeyError or RecursionError out of the driver."""

    @pytest.mark.parametrize(
        ("respond", "act"),
        [
            (rewrite_port_state(lambda a: GetPhysicalPortStateResponse(())), lambda f: f.bind("f/port2", "h0", ctx())),
            (
                rewrite_port_state(
                    lambda a: GetPhysicalPortStateResponse(
                        tuple(attrs.evolve(p, port_id=p.port_id + 100) for p in a.ports)
                    )
                ),
                lambda f: f.discover(),
            ),
            (rewrite_vcs_info(other_vcs_ids), lambda f: f.bindings()),
            (rewrite_vcs_info(bound_to_ld_9), lambda f: f.pool(MLD_POOL).allocations()),
            (background_started, lambda f: f.bind("f/port3", "h1", ctx())),
        ],
        ids=["no-port-block", "other-port-ids", "other-vcs-ids", "ld-beyond-the-mld", "status-started"],
    )
    def test_in_a_call(self, bench: Bench, respond: Respond, act: Callable[[CxlSwitchFabric], object]) -> None:
        bench.respond(respond)
        with pytest.raises(FabricUnavailableError, match="malformed"):
            act(bench.fabric)

    @pytest.mark.parametrize(
        ("opcode", "payload", "changes"),
        [
            (BACKGROUND_OPERATION_STATUS, b"", False),
            (Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(GPU_PORT, PortOpcode.RESET_PPB).encode(), True),
        ],
        ids=["query", "change"],
    )
    def test_only_bind_and_unbind_run_in_the_background(
        self, bench: Bench, opcode: int, payload: bytes, changes: bool
    ) -> None:
        """Background Command Started for another command is malformed; for one that changes the switch, which
        may have acted, its outcome is unknown."""

        def started(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if request.opcode != opcode:
                return response
            return attrs.evolve(response, return_code=ReturnCode.BACKGROUND_COMMAND_STARTED, payload=b"")

        bench.respond(started)
        with pytest.raises(FabricUnavailableError, match="malformed") as raised:
            bench.peer.call(opcode, payload)
        assert in_doubt(raised.value) is changes


class TestReleasedDCDAllocations:
    """A released DCD allocation's name leaves driver-state.json; one whose release failed stays until a retry
    releases it."""

    def test_no_name_outlives_its_release(self, tmp_path: Path) -> None:
        bench = Bench(tmp_path, state_dir=tmp_path / "state")
        try:
            pool = bench.pool(DCD_POOL)
            for n in range(3):
                pool.allocate(f"job-{n}", "h0", 2 * MIB, ctx())
                pool.release(f"job-{n}", ctx())
            assert tags(tmp_path / "state") == {}
            assert pool.allocations() == []
        finally:
            bench.close()

    def test_a_failed_release_keeps_the_name(self, tmp_path: Path) -> None:
        bench = Bench(tmp_path, state_dir=tmp_path / "state")
        try:
            pool = bench.pool(DCD_POOL)
            pool.allocate("a", "h0", 2 * MIB, ctx())
            bench.fabric.fail_device(f"f/port{DCD_PORT}")
            with pytest.raises(FabricUnavailableError):
                pool.release("a", ctx())
            assert list(tags(tmp_path / "state").values()) == ["a"]
            bench.fabric.repair_device(f"f/port{DCD_PORT}")
            assert [a.id for a in pool.allocations()] == ["a"]
            pool.release("a", ctx())
            assert tags(tmp_path / "state") == {} and pool.allocations() == []
        finally:
            bench.close()


def tags(state_dir: Path) -> dict[str, str]:
    return dict(json.loads((state_dir / "driver-state.json").read_text()).get("tags", {}))


class TestEventLogGap:
    """Records the switch's log dropped before the poller read them are a gap: logged, and each device's health
    read from its port and published, so that subscribers still learn of a failure the lost records held."""

    def test_a_failure_in_the_gap_is_published(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        bench = Bench(tmp_path, event_capacity=4)
        try:
            seen: list[FabricEvent] = []
            bench.fabric.subscribe(seen.append)
            with caplog.at_level(logging.WARNING, logger="disagg.cxl_switch"), held_event_polls(bench):
                bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU_PORT))  # lost in the gap
                wrap_the_log(bench)
            wait_until(lambda: ("f/port2", Health.FAILED) in [(e.subject, e.health) for e in seen])
            assert "dropped records" in caplog.text
            last = {e.subject: e.health for e in seen}
            assert last["f/port3"] is Health.OK
        finally:
            bench.close()

    def test_a_failure_the_ports_read_told_is_not_told_again_by_its_record(self, tmp_path: Path) -> None:
        """A device that fails between the poller's read of the log after a gap and its read of the ports is told
        FAILED by that read; its record, read at the next poll, tells the same change and is not told again (it
        was: FAILED twice). The health told last is still the switch's: the repair that follows is told."""
        bench = Bench(tmp_path, event_capacity=4)
        try:
            seen: list[FabricEvent] = []
            bench.fabric.subscribe(seen.append)
            bench.respond(fails_after_the_gap_is_read(bench))
            port2_failed_once_then_repaired(bench, seen)
        finally:
            bench.close()

    def test_after_a_restart_too(self, tmp_path: Path) -> None:
        """The same, the ports read because the switch restarted (its log numbers from 1 again)."""
        bench = Bench(tmp_path)
        try:
            seen: list[FabricEvent] = []
            bench.fabric.subscribe(seen.append)
            bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(OTHER_GPU_PORT))  # its place past 1
            wait_until(lambda: bool(seen))
            bench.respond(fails_after_the_restart_is_read(bench))
            bench.restart()
            port2_failed_once_then_repaired(bench, seen)
        finally:
            bench.close()


def port2_failed_once_then_repaired(bench: Bench, seen: list[FabricEvent]) -> None:
    """Repair port 2 once its failure, read from the ports, was told, and fail it again: port 2's events are that
    failure and the two records after its own, nothing between (a later failure is told)."""

    def port2() -> list[tuple[Health | None, str]]:
        return [(e.health, e.message) for e in seen if e.subject == "f/port2"]

    wait_until(lambda: len(port2()) >= 1)
    bench.peer.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(GPU_PORT, PortOpcode.RESET_PPB))
    wait_until(lambda: len(port2()) >= 2)
    bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU_PORT))
    wait_until(lambda: len(port2()) >= 3)
    assert port2() == [
        (Health.FAILED, "port 2: FAILED, read after the event log dropped records"),
        (Health.OK, "port 2: link up"),
        (Health.FAILED, "port 2: link down"),
    ]


def wrap_the_log(bench: Bench) -> None:
    """A burst on the other GPU (link down and up, three times): six records, past a log of four."""
    for _ in range(3):
        bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(OTHER_GPU_PORT))
        bench.peer.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(OTHER_GPU_PORT, PortOpcode.RESET_PPB))


def fails_after_the_gap_is_read(bench: Bench) -> Respond:
    """Answer the poller's next read of the log, then wrap the log with a burst on the other GPU; once the read
    that finds the gap is answered, fail the GPU on port 2, before the poller reads the ports."""
    burst = threading.Event()
    failed = threading.Event()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode != VendorOpcode.GET_EVENT_RECORDS or failed.is_set():
            return response
        if not burst.is_set():
            burst.set()
            wrap_the_log(bench)
        elif GetEventRecordsResponse.decode(response.payload).oldest_sequence > (
            GetEventRecordsRequest.decode(request.payload).first_sequence
        ):
            failed.set()
            bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU_PORT))
        return response

    return respond


def fails_after_the_restart_is_read(bench: Bench) -> Respond:
    """Once the poller's read of a restarted switch from its first record is answered, fail the GPU on port 2,
    before the poller reads the ports."""
    restarted = threading.Event()
    failed = threading.Event()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode != VendorOpcode.GET_EVENT_RECORDS or failed.is_set():
            return response
        if restarted.is_set():
            failed.set()
            bench.peer.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU_PORT))
        elif GetEventRecordsResponse.decode(response.payload).next_sequence < (
            GetEventRecordsRequest.decode(request.payload).first_sequence
        ):
            restarted.set()  # the poller reads again from the new switch's oldest record
        return response

    return respond


@contextlib.contextmanager
def held_event_polls(bench: Bench) -> Iterator[None]:
    """Hold the poller's next Get Event Records answer (read before the block's events) until the block ends, so
    that all of them happen between two of its reads."""
    gate, held = threading.Event(), threading.Event()

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode == VendorOpcode.GET_EVENT_RECORDS and not gate.is_set():
            held.set()
            gate.wait(WAIT_S)
        return response

    bench.respond(respond)
    try:
        assert held.wait(WAIT_S), "the poller never polled"
        yield
    finally:
        gate.set()


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


class TestInjectedBindFailureIsSpent:
    """An armed Inject Bind Failure is spent by the next Bind vPPB, even one the switch refuses at once: it never
    fails a later bind that nobody armed."""

    def test_in_the_emulator(self) -> None:
        fm = Client(in_process(Switch(default_topology(gpus=2, ld_count=0, dc_capacity=0), bind_delay=0.0)))
        assert fm.call(VendorOpcode.INJECT_BIND_FAILURE).return_code == ReturnCode.SUCCESS
        assert fm.call(Opcode.BIND_VPPB, BindVPPBRequest(H0_VCS, 200, GPU_PORT)).return_code == ReturnCode.INVALID_INPUT
        started = fm.call(Opcode.BIND_VPPB, BindVPPBRequest(H0_VCS, 0, GPU_PORT))
        assert started.return_code == ReturnCode.BACKGROUND_COMMAND_STARTED
        assert fm.wait_background().return_code == ReturnCode.SUCCESS

    def test_a_refused_bind_leaves_no_failure_for_another_device(self, bench: Bench) -> None:
        """The peer binds port 2 after the driver read it free; the driver's armed bind of it is refused (the
        device is busy), and its next bind, of port 3, which nobody armed, succeeds."""
        peer_bind = BindVPPBRequest(H1_VCS, 5, GPU_PORT)
        bench.respond(
            once(
                lambda r: r.opcode == Opcode.GET_VIRTUAL_CXL_SWITCH_INFO,
                lambda: bench.peer.call(Opcode.BIND_VPPB, peer_bind),
            )
        )
        bench.fabric.flaky_bind("f/port2", 1)
        with pytest.raises(DeviceBusyError):
            bench.fabric.bind("f/port2", "h0", ctx())
        assert bench.fabric.bind("f/port3", "h0", ctx()) == Binding("f/port3", "h0")
