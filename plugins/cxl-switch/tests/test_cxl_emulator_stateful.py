"""A Hypothesis state machine drives bind, unbind, LD allocation and DC add/release against a simple model, and
checks after every step that the emulator reports what the model holds: in process, and once over a socket."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from cxl_switch_client import Client, SocketTransport, emulator_process, in_process
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.state import GIB, MIB
from disagg_cxl_switch.emulator.vendor import VendorOpcode
from disagg_cxl_switch.fmapi import (
    LD_ID_NOT_MLD,
    BindVPPBRequest,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    LDAllocation,
    Opcode,
    RemovalPolicy,
    SelectionPolicy,
    SetLDAllocationsRequest,
    UnbindVPPBRequest,
    VPPBBindingStatus,
)
from disagg_cxl_switch.returncodes import ReturnCode
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

HOSTS, GPUS, LDS = 2, 3, 4
GPU_PORTS = range(HOSTS, HOSTS + GPUS)
MLD_PORT = HOSTS + GPUS
DCD_PORT = MLD_PORT + 1
VPPBS = GPUS + 2
LD_UNITS = 64 * GIB // (256 * MIB)  # 256 MiB units of the MLD
REGION = 4 * GIB
BLOCK = 2 * MIB
TAGS = [bytes([t]) * 16 for t in (1, 2, 3)]


def topology_switch() -> Switch:
    state = default_topology(hosts=HOSTS, gpus=GPUS, ld_count=LDS, mld_capacity=64 * GIB, dc_capacity=2 * REGION)
    return Switch(state, bind_delay=0)


class FabricMachine(RuleBasedStateMachine):
    """The model: vPPB bindings, LD allocations, and DC bytes per (host, tag, region)."""

    make_client: ClassVar[Callable[[], Client]] = staticmethod(lambda: Client(in_process(topology_switch())))

    def __init__(self) -> None:
        super().__init__()
        self.fm = self.make_client()
        self.bindings: dict[tuple[int, int], tuple[int, int | None]] = {}
        self.allocations = [(LD_UNITS // LDS, 0)] * LDS
        self.dc: Counter[tuple[int, bytes, int]] = Counter()

    @initialize()
    def start(self) -> None:
        assert self.fm.call(VendorOpcode.RESET).return_code == ReturnCode.SUCCESS

    # -- rules ------------------------------------------------------------------------------------------------

    @rule(
        vcs=st.integers(0, HOSTS - 1),
        vppb=st.integers(0, VPPBS - 1),
        port=st.sampled_from([*GPU_PORTS, DCD_PORT]),
        ld=st.sampled_from([LD_ID_NOT_MLD, LD_ID_NOT_MLD, LD_ID_NOT_MLD, 0]),
    )
    def bind_port(self, vcs: int, vppb: int, port: int, ld: int) -> None:
        self.bind(vcs, vppb, port, ld)

    @rule(
        vcs=st.integers(0, HOSTS - 1),
        vppb=st.integers(0, VPPBS - 1),
        ld=st.sampled_from([0, 1, 0, 1, LDS, LD_ID_NOT_MLD]),
    )
    def bind_ld(self, vcs: int, vppb: int, ld: int) -> None:
        self.bind(vcs, vppb, MLD_PORT, ld)

    def bind(self, vcs: int, vppb: int, port: int, ld: int) -> None:
        taken = set(self.bindings.values())
        if port == MLD_PORT:
            valid = ld < LDS and (port, ld) not in taken
        else:
            valid = ld == LD_ID_NOT_MLD and not any(p == port for p, _ in taken)
        valid = valid and (vcs, vppb) not in self.bindings
        response = self.fm.call(Opcode.BIND_VPPB, BindVPPBRequest(vcs, vppb, port, ld))
        if not valid:
            assert response.return_code == ReturnCode.INVALID_INPUT
            return
        assert response.return_code == ReturnCode.BACKGROUND_COMMAND_STARTED
        assert self.fm.wait_background().return_code == ReturnCode.SUCCESS
        self.bindings[vcs, vppb] = (port, ld if port == MLD_PORT else None)

    @rule(vcs=st.integers(0, HOSTS - 1), vppb=st.integers(0, VPPBS - 1))
    def unbind(self, vcs: int, vppb: int) -> None:
        response = self.fm.call(Opcode.UNBIND_VPPB, UnbindVPPBRequest(vcs, vppb))
        if (vcs, vppb) not in self.bindings:
            assert response.return_code == ReturnCode.INVALID_INPUT
            return
        assert response.return_code == ReturnCode.BACKGROUND_COMMAND_STARTED
        assert self.fm.wait_background().return_code == ReturnCode.SUCCESS
        del self.bindings[vcs, vppb]

    @rule(
        start=st.integers(0, LDS),
        units=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 40)), min_size=0, max_size=LDS),
    )
    def set_ld_allocations(self, start: int, units: list[tuple[int, int]]) -> None:
        request = SetLDAllocationsRequest(start, tuple(LDAllocation(a, b) for a, b in units))
        response = self.fm.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, request)
        proposed = list(self.allocations)
        proposed[start : start + len(units)] = units
        if not units or start + len(units) > LDS:
            assert response.return_code == ReturnCode.INVALID_INPUT
        elif sum(a + b for a, b in proposed) > LD_UNITS:
            assert response.return_code == ReturnCode.RESOURCES_EXHAUSTED
        else:
            assert response.return_code == ReturnCode.SUCCESS
            self.allocations = proposed

    @rule(
        host=st.integers(0, HOSTS - 1),
        region=st.integers(0, 1),
        blocks=st.sampled_from([0, 1, 3, 512, REGION // BLOCK]),
        tag=st.sampled_from(TAGS),
    )
    def dc_add(self, host: int, region: int, blocks: int, tag: bytes) -> None:
        length = blocks * BLOCK
        request = InitiateDCAddRequest(host, SelectionPolicy.FREE, region, length, tag)
        response = self.fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_ADD, request)
        free = REGION - sum(n for (_, _, r), n in self.dc.items() if r == region)
        if length == 0:
            assert response.return_code == ReturnCode.INVALID_INPUT
        elif length > free:
            assert response.return_code == ReturnCode.RESOURCES_EXHAUSTED
        else:
            assert response.return_code == ReturnCode.SUCCESS
            self.dc[host, tag, region] += length

    @rule(host=st.integers(0, HOSTS - 1), tag=st.sampled_from(TAGS))
    def dc_release_tag(self, host: int, tag: bytes) -> None:
        request = InitiateDCReleaseRequest(host, RemovalPolicy.TAG_BASED, 0, tag)
        response = self.fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_RELEASE, request)
        held = [key for key, n in self.dc.items() if key[:2] == (host, tag) and n]
        if not held:
            assert response.return_code == ReturnCode.INVALID_EXTENT_LIST
            return
        assert response.return_code == ReturnCode.SUCCESS
        for key in held:
            del self.dc[key]

    @rule(host=st.integers(0, HOSTS - 1), pick=st.integers(0, 1000))
    def dc_release_one_block(self, host: int, pick: int) -> None:
        """Prescriptive release of the first block of one extent the host holds (read from the emulator)."""
        held = self.extents(host)
        if not held.extents:
            return
        extent = held.extents[pick % len(held.extents)]
        part = type(extent)(extent.start_dpa, BLOCK)
        request = InitiateDCReleaseRequest(host, RemovalPolicy.PRESCRIPTIVE, BLOCK, extents=(part,))
        assert self.fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_RELEASE, request).return_code == ReturnCode.SUCCESS
        key = (host, extent.tag, extent.start_dpa // REGION)
        self.dc[key] -= BLOCK
        if not self.dc[key]:
            del self.dc[key]

    # -- the emulator agrees with the model --------------------------------------------------------------------

    def extents(self, host: int) -> GetDCRegionExtentListsResponse:
        response = self.fm.tunnel(
            DCD_PORT, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(host, 1000)
        )
        assert response.return_code == ReturnCode.SUCCESS
        return GetDCRegionExtentListsResponse.decode(response.payload)

    @invariant()
    def bindings_agree(self) -> None:
        request = GetVirtualCxlSwitchInfoRequest(0, 0xFF, tuple(range(HOSTS)))
        response = self.fm.call(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, request)
        seen: dict[tuple[int, int], tuple[int, int | None]] = {}
        for vcs in GetVirtualCxlSwitchInfoResponse.decode(response.payload).vcss:
            for vppb_id, vppb in enumerate(vcs.vppbs):
                assert vppb.binding_status != VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS
                if vppb.binding_status != VPPBBindingStatus.UNBOUND:
                    ld = None if vppb.binding_status == VPPBBindingStatus.BOUND_PHYSICAL_PORT else vppb.bound_ld_id
                    seen[vcs.vcs_id, vppb_id] = (vppb.bound_port_id, ld)
        assert seen == self.bindings

    @invariant()
    def ld_allocations_agree(self) -> None:
        response = self.fm.tunnel(MLD_PORT, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest())
        allocations = GetLDAllocationsResponse.decode(response.payload).allocations
        assert [(a.range_1_allocation_multiplier, a.range_2_allocation_multiplier) for a in allocations] == (
            self.allocations
        )

    @invariant()
    def dc_capacity_agrees(self) -> None:
        seen: Counter[tuple[int, bytes, int]] = Counter()
        spans = []
        for host in range(HOSTS):
            for extent in self.extents(host).extents:
                assert extent.start_dpa % BLOCK == 0 and extent.length % BLOCK == 0 and extent.length > 0
                seen[host, extent.tag, extent.start_dpa // REGION] += extent.length
                spans.append((extent.start_dpa, extent.start_dpa + extent.length))
        assert seen == +self.dc
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), "extents overlap"


def test_in_process() -> None:
    run_state_machine_as_test(
        FabricMachine,
        settings=settings(
            max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


def test_over_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "switch.sock"
    args = [
        "--hosts",
        str(HOSTS),
        "--gpus",
        str(GPUS),
        "--ld-count",
        str(LDS),
        "--dc-capacity-gib",
        "8",
        "--bind-delay-ms",
        "0",
    ]
    with emulator_process(path, *args):
        transport = SocketTransport(path)
        try:

            class OverSocket(FabricMachine):
                make_client = staticmethod(lambda: Client(transport))

            run_state_machine_as_test(
                OverSocket,
                settings=settings(
                    max_examples=8, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)
                ),
            )
        finally:
            transport.close()
