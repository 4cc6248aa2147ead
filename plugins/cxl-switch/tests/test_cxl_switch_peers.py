"""The driver on a switch another fabric manager also commands, over a connection of its own: what the peer does
between the driver's read of the switch and its command, or between the command and its status, must not be
taken for the caller's mistake nor for the driver's own success."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from cxl_switch_served import ServedSwitch, command_of
from cxl_switch_wire import ld_units
from disagg.composer import FabricComposer
from disagg.composer.execution import in_doubt
from disagg.errors import DeviceBusyError, DisaggError, FabricUnavailableError, InvalidRequestError
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg.requestlang import parse_request
from disagg_cxl_switch import CCIMessage
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric
from disagg_cxl_switch.driver.client import CCIClient, CommandFailedError
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.state import GIB
from disagg_cxl_switch.emulator.vendor import VendorOpcode
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    GetDCRegionExtentListsRequest,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    LDAllocation,
    Opcode,
    RemovalPolicy,
    SelectionPolicy,
    SetDCRegionConfigRequest,
    SetLDAllocationsRequest,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    UnbindOption,
    UnbindVPPBRequest,
)
from disagg_cxl_switch.returncodes import ReturnCode

MIB = 1 << 20
H1_VCS = 1
GPU_PORT, OTHER_GPU_PORT, MLD_PORT = 2, 3, 4
DCD_PORT = 4
"""Where the DCD sits on a switch without an MLD."""

TAGS = [i.to_bytes(16, "little") for i in range(1, 66)]
"""Tags of the peer's 65 extents: one more than a page."""


def ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


class Bench:
    """A served switch (two hosts, GPUs on ports 2 and 3, a 4-LD MLD on 4), the driver's fabric on it, and the
    peer's client."""

    def __init__(self, folder: Path) -> None:
        state = default_topology(gpus=2, ld_count=4, mld_capacity=4 * GIB, dc_capacity=0)
        self.served = ServedSwitch(Switch(state, bind_delay=0.0), folder / "s.sock")
        self.peer = CCIClient(self.served.address)
        self.fabric: CxlSwitchFabric = create_fabric("f", {"address": self.served.address, "gpus": 2})

    def after_first(self, opcode: int, act: Callable[[], object]) -> None:
        """Let the peer ``act`` once the switch has answered the driver's next request about ``opcode``."""
        armed = threading.Event()
        armed.set()

        def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) == opcode and armed.is_set():
                armed.clear()
                act()
            return response

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


def test_a_port_the_peer_bound_after_the_drivers_read_is_busy(bench: Bench) -> None:
    """Bind vPPB answers Invalid Input (port already bound): not the caller's mistake, the device is taken."""
    bench.after_first(
        Opcode.GET_VIRTUAL_CXL_SWITCH_INFO,
        lambda: bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, GPU_PORT)),
    )
    with pytest.raises(DeviceBusyError):
        bench.fabric.bind("f/port2", "h0", ctx())
    assert bench.fabric.bindings() == [Binding("f/port2", "h1")]


def test_a_status_the_peer_replaced_is_no_success(bench: Bench) -> None:
    """The driver's Bind vPPB fails in the background; before the driver reads Background Operation Status, the
    peer's Unbind vPPB replaces it with its own success. The driver's outcome is then unknown, not success."""
    bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, OTHER_GPU_PORT))
    unbind = UnbindVPPBRequest(H1_VCS, 0, UnbindOption.MANAGED_HOT_REMOVE)
    bench.after_first(Opcode.BIND_VPPB, lambda: bench.peer.call(Opcode.UNBIND_VPPB, unbind))
    bench.fabric.flaky_bind("f/port2", 1)
    with pytest.raises(FabricUnavailableError) as raised:
        bench.fabric.bind("f/port2", "h0", ctx())
    assert in_doubt(raised.value)
    assert bench.fabric.bindings() == []


def test_an_ld_the_peer_bound_after_the_drivers_read_is_retried(bench: Bench) -> None:
    """Bind vPPB of the LD the driver picked answers Invalid Input (LD already bound): the carve is retryable, and a
    retry carves another LD."""
    bench.after_first(
        Opcode.GET_VIRTUAL_CXL_SWITCH_INFO,
        lambda: bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, MLD_PORT, 0)),
    )
    pool = bench.fabric.pool(f"f/mld-port{MLD_PORT}")
    with pytest.raises(FabricUnavailableError):
        pool.allocate("a", "h0", GIB, ctx())
    retried = pool.allocate("a", "h0", GIB, ctx())
    assert sorted((a.id, a.host) for a in pool.allocations()) == [("a", "h0"), ("ld-0", "h1")]
    assert retried.amount_bytes == GIB


@pytest.mark.parametrize("named", ["ld-0", "tag-" + "ab" * 16])
def test_an_id_of_the_form_the_peer_s_memory_is_listed_by_is_refused(bench: Bench, named: str) -> None:
    """The pool lists an LD the peer bound as ``ld-<n>`` (a tag it did not set as ``tag-<hex>``): an allocation
    under that id was taken for the peer's memory, answered without a carve, and its release freed the peer's."""
    bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, MLD_PORT, 0))
    pool = bench.fabric.pool(f"f/mld-port{MLD_PORT}")
    before = sorted((a.id, a.host) for a in pool.allocations())
    assert before == [("ld-0", "h1")]
    with pytest.raises(InvalidRequestError, match="choose another id") as refused:
        pool.allocate(named, "h1", GIB, ctx())
    assert refused.value.field == "allocation_id"
    assert sorted((a.id, a.host) for a in pool.allocations()) == before


def test_a_dc_region_the_peer_reconfigured_is_read_again(tmp_path: Path) -> None:
    """The peer sets the DCD's empty region to 256 MiB blocks after the driver read its 2 MiB ones: the driver kept
    rounding to 2 MiB, and the DCD refused every add with Invalid Input, which the driver answers as retryable, for
    good. The refusal makes it read the regions again, and the retry it invites carves."""
    state = default_topology(gpus=2, ld_count=0, dc_capacity=GIB, dc_regions=1)
    served = ServedSwitch(Switch(state, bind_delay=0.0), tmp_path / "s.sock")
    fabric = create_fabric("f", {"address": served.address, "gpus": 2})
    peer = CCIClient(served.address)
    try:
        pool = fabric.pool(f"f/dcd-port{DCD_PORT}")
        assert pool.info().capacity.block_bytes == 2 * MIB
        peer.tunnel(DCD_PORT, Opcode.SET_DC_REGION_CONFIG, SetDCRegionConfigRequest(0, 256 * MIB))
        with pytest.raises(FabricUnavailableError) as refused:
            pool.allocate("m", "h0", 2 * MIB, ctx())
        assert refused.value.retryable
        assert pool.allocate("m", "h0", 2 * MIB, ctx()).amount_bytes == 256 * MIB
        assert pool.info().capacity.block_bytes == 256 * MIB
    finally:
        fabric.close()
        peer.close()
        served.close()


class TestExtentListPaging:
    """A host's extent list longer than one read (64 extents) is paged by starting index, while the peer adds or
    releases extents. The DCD returns the list's generation number with each page."""

    @pytest.fixture
    def dcd(self, tmp_path: Path) -> Iterator[tuple[ServedSwitch, CxlSwitchFabric, CCIClient]]:
        """A switch whose DCD's host 0 holds 65 extents of 2 MiB, tags 1 to 65, added by the peer."""
        state = default_topology(gpus=2, ld_count=0, dc_capacity=GIB, dc_regions=1)
        served = ServedSwitch(Switch(state, bind_delay=0.0), tmp_path / "s.sock")
        fabric = create_fabric("f", {"address": served.address, "gpus": 2})
        peer = CCIClient(served.address)
        try:
            for tag in TAGS:
                add = InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, tag)
                peer.tunnel(DCD_PORT, Opcode.INITIATE_DC_ADD, add)
            yield served, fabric, peer
        finally:
            fabric.close()
            peer.close()
            served.close()

    @pytest.mark.parametrize("released", [1, 2])
    def test_a_list_changed_between_pages_is_read_again(
        self, dcd: tuple[ServedSwitch, CxlSwitchFabric, CCIClient], released: int
    ) -> None:
        """The peer releases the first extents once the driver has read the first page. The second page, from
        index 64 of the shorter list, was empty (one released: the pool listed it as held and lost the last
        extent) or refused (two: the pool was unavailable). The list is read again from the start."""
        served, fabric, peer = dcd
        armed = threading.Event()
        armed.set()

        def peer_releases(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) == Opcode.GET_DC_REGION_EXTENT_LISTS and armed.is_set():
                armed.clear()
                for tag in TAGS[:released]:
                    release = InitiateDCReleaseRequest(0, RemovalPolicy.TAG_BASED, 2 * MIB, tag)
                    peer.tunnel(DCD_PORT, Opcode.INITIATE_DC_RELEASE, release)
            return response

        served.respond = peer_releases
        listed = fabric.pool(f"f/dcd-port{DCD_PORT}").allocations()
        assert not armed.is_set()
        assert sorted(a.id for a in listed) == sorted(f"tag-{tag.hex()}" for tag in TAGS[released:])

    def test_a_list_that_keeps_changing_is_unavailable(
        self, dcd: tuple[ServedSwitch, CxlSwitchFabric, CCIClient]
    ) -> None:
        """The peer adds an extent after every first page: the reads from the start are bounded, then the call
        fails, retryable, saying why."""
        served, fabric, peer = dcd
        more = iter(range(66, 100))

        def peer_adds(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) == Opcode.GET_DC_REGION_EXTENT_LISTS:
                inner = TunnelManagementCommandRequest.decode(request.payload).command
                if GetDCRegionExtentListsRequest.decode(inner.payload).starting_extent_index == 0:
                    tag = next(more).to_bytes(16, "little")
                    add = InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, tag)
                    peer.tunnel(DCD_PORT, Opcode.INITIATE_DC_ADD, add)
            return response

        served.respond = peer_adds
        with pytest.raises(FabricUnavailableError, match="changed between its pages 3 times") as raised:
            fabric.pool(f"f/dcd-port{DCD_PORT}").allocations()
        assert raised.value.retryable

    def test_a_later_page_refused_of_an_unchanged_list_is_that_refusal(
        self, dcd: tuple[ServedSwitch, CxlSwitchFabric, CCIClient]
    ) -> None:
        """The DCD refuses every page past the first with Invalid Input while the list stays as it was (the same
        generation number on each first page): it did not shrink, so the pool's error is the DCD's refusal, not a
        list "changed between its pages" by another fabric manager that nothing changed."""
        served, fabric, _ = dcd
        firsts: list[int] = []

        def refuse_later_pages(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            if command_of(request) != Opcode.GET_DC_REGION_EXTENT_LISTS:
                return response
            inner = TunnelManagementCommandRequest.decode(request.payload).command
            if GetDCRegionExtentListsRequest.decode(inner.payload).starting_extent_index == 0:
                firsts.append(1)
                return response
            refused = inner.response(ReturnCode.INVALID_INPUT)
            return attrs.evolve(response, payload=TunnelManagementCommandResponse(refused).encode())

        served.respond = refuse_later_pages
        with pytest.raises(FabricUnavailableError, match="INVALID_INPUT") as raised:
            fabric.pool(f"f/dcd-port{DCD_PORT}").allocations()
        assert "changed between its pages" not in raised.value.message
        assert len(firsts) == 2, "the list was read again after it was seen unchanged"

    def test_an_added_extent_whose_list_cannot_be_read_back_is_released(
        self, dcd: tuple[ServedSwitch, CxlSwitchFabric, CCIClient]
    ) -> None:
        """The DCD adds the composer's extent; then the peer adds one after each first page of the read back, so
        the list never reads whole and the pool raises. The add happened: an error that says the call changed
        nothing left the extent carved, and the composer, which undoes only what may have happened, never
        released it (the next pass quarantined it as memory no composition records)."""
        served, fabric, peer = dcd
        more = iter(range(66, 69))
        added = threading.Event()

        def peer_adds_after_the_add(request: CCIMessage, response: CCIMessage) -> CCIMessage:
            opcode = command_of(request)
            if opcode == Opcode.INITIATE_DC_ADD and response.return_code == ReturnCode.SUCCESS:
                added.set()
            elif opcode == Opcode.GET_DC_REGION_EXTENT_LISTS and added.is_set():
                inner = TunnelManagementCommandRequest.decode(request.payload).command
                if GetDCRegionExtentListsRequest.decode(inner.payload).starting_extent_index == 0:
                    tag = next(more, None)
                    if tag is not None:
                        add = InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, tag.to_bytes(16, "little"))
                        peer.tunnel(DCD_PORT, Opcode.INITIATE_DC_ADD, add)
            return response

        comp = FabricComposer({"f": fabric}, auto_heal=False)
        comp.start()
        try:
            served.respond = peer_adds_after_the_add
            with pytest.raises(FabricUnavailableError, match="changed between its pages"):
                comp.compose(parse_request("m", ["host h0", "cxl-memory 2MiB"]))
            assert added.is_set() and next(more, None) is None
            listed = fabric.pool(f"f/dcd-port{DCD_PORT}").allocations()
            assert all(a.id.startswith("tag-") for a in listed), "the composition's extent is left on the switch"
            assert comp.compositions() == []
        finally:
            comp.close()


def bind_gpu(bench: Bench) -> object:
    return bench.fabric.bind("f/port2", "h0", ctx())


def allocate_ld(bench: Bench) -> object:
    return bench.fabric.pool(f"f/mld-port{MLD_PORT}").allocate("a", "h0", GIB, ctx())


@pytest.mark.parametrize(
    ("device", "act"), [("f/port2", bind_gpu), (f"f/port{MLD_PORT}", allocate_ld)], ids=["bind", "ld"]
)
def test_a_status_the_peers_bind_replaced_is_no_success(
    bench: Bench, device: str, act: Callable[[Bench], object]
) -> None:
    """The driver's Bind vPPB fails in the background; before the driver reads Background Operation Status, the
    peer's Bind vPPB, of the same opcode, replaces it with its own success. The switch does not hold what the
    driver asked for, so its outcome is unknown, not the peer's success."""
    peer_bind = BindVPPBRequest(H1_VCS, 0, OTHER_GPU_PORT)
    bench.after_first(Opcode.BIND_VPPB, lambda: bench.peer.call(Opcode.BIND_VPPB, peer_bind))
    bench.fabric.flaky_bind(device, 1)
    with pytest.raises(FabricUnavailableError) as raised:
        act(bench)
    assert in_doubt(raised.value)
    assert bench.fabric.bindings() == [Binding("f/port3", "h1")]
    assert bench.fabric.pool(f"f/mld-port{MLD_PORT}").allocations() == []


def test_a_status_the_peers_failed_bind_replaced_is_no_failure(bench: Bench) -> None:
    """The driver's Bind vPPB succeeds; before the driver reads the status, the peer's Bind vPPB fails and replaces
    it. The switch holds the driver's binding: a failure would leave it bound, unknown to the caller."""

    def peer_bind_fails() -> None:
        bench.peer.call(VendorOpcode.INJECT_BIND_FAILURE)
        with contextlib.suppress(CommandFailedError):
            bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, OTHER_GPU_PORT))

    bench.after_first(Opcode.BIND_VPPB, peer_bind_fails)
    assert bench.fabric.bind("f/port2", "h0", ctx()) == Binding("f/port2", "h0")
    assert bench.fabric.bindings() == [Binding("f/port2", "h0")]


def test_a_failed_carve_leaves_the_ld_the_peer_carved_since(bench: Bench) -> None:
    """Once the driver's carve has set the unbound LDs 1-3 to 0, the peer gives LD 1 memory and binds it; the
    driver's LD bind then fails. Its rollback sets back only the LDs it changed that nobody took since."""
    pool = bench.fabric.pool(f"f/mld-port{MLD_PORT}")
    assert ld_units(bench.served.address, MLD_PORT) == [4, 4, 4, 4]

    def peer_carves_ld_1() -> None:
        bench.peer.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, SetLDAllocationsRequest(1, (LDAllocation(2, 0),)))
        bench.peer.call(Opcode.BIND_VPPB, BindVPPBRequest(H1_VCS, 0, MLD_PORT, 1))

    bench.after_first(Opcode.SET_LD_ALLOCATIONS, peer_carves_ld_1)
    bench.fabric.flaky_bind(f"f/port{MLD_PORT}", 1)
    with pytest.raises(FabricUnavailableError, match="INTERNAL_ERROR") as raised:
        pool.allocate("a", "h0", 2 * GIB, ctx())
    assert not in_doubt(raised.value)
    assert ld_units(bench.served.address, MLD_PORT) == [4, 2, 4, 4]
    assert [(a.id, a.host, a.amount_bytes) for a in pool.allocations()] == [("ld-1", "h1", GIB // 2)]
