"""Unit tests of `disagg.codec`: every model value survives a trip through JSON unchanged."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import cattrs
import pytest
from disagg import codec
from disagg.interfaces import ComposeResult
from disagg.model import (
    CXL_DC_BLOCK_BYTES,
    Affinity,
    Allocation,
    Binding,
    Capabilities,
    Capacity,
    ChangeKind,
    ComposeMode,
    Composition,
    CompositionRequest,
    CompositionState,
    Device,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    Extent,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    Host,
    HostRequest,
    Link,
    MemoryPick,
    PendingChange,
    Plan,
    PoolInfo,
    PoolKind,
    Port,
    PortKind,
    PriorState,
    Reservation,
    ResourceRequest,
    Selector,
    SelectorOp,
    Switch,
    SwitchKind,
    Topology,
)
from hypothesis import given
from hypothesis import strategies as st

GiB = 1 << 30

# -- strategies ------------------------------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
scalars = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(1 << 62), max_value=1 << 62),
    st.floats(allow_nan=False),
    st.booleans(),
)
labels = st.dictionaries(names, st.text(max_size=8), max_size=3)
capacities = st.builds(
    lambda blocks, block: Capacity(blocks * block, block),
    st.integers(min_value=0, max_value=1 << 20),
    st.sampled_from([CXL_DC_BLOCK_BYTES, 1 << 20, GiB]),
)
devices = st.builds(
    Device,
    id=names.map(lambda s: f"f/{s}"),
    fabric=st.just("f"),
    kind=st.sampled_from(DeviceKind),
    serial=names,
    vendor=st.text(max_size=8),
    model=st.text(max_size=8),
    switch=st.text(max_size=8),
    link_latency_ns=st.integers(min_value=0, max_value=10**6),
    attributes=st.dictionaries(names, scalars, max_size=5),
    capacity=st.none() | capacities,
    health=st.sampled_from(Health),
    failure_domains=labels,
)
selectors = st.builds(Selector, key=names, op=st.sampled_from(SelectorOp), value=scalars)


@st.composite
def resource_requests(draw: st.DrawFn) -> ResourceRequest:
    kind = draw(st.sampled_from(DeviceKind))
    carved = kind is DeviceKind.CXL_MEMORY and draw(st.booleans())
    return ResourceRequest(
        kind=kind,
        count=0 if carved else draw(st.integers(min_value=1, max_value=64)),
        amount_bytes=draw(st.integers(min_value=1, max_value=1 << 50)) if carved else 0,
        selectors=tuple(draw(st.lists(selectors, max_size=3))),
        max_latency_ns=draw(st.none() | st.integers(min_value=0, max_value=10**7)),
        affinity=draw(st.sampled_from(Affinity)),
        spread=draw(st.none() | names),
    )


composition_requests = st.builds(
    CompositionRequest,
    name=names,
    resources=st.lists(resource_requests(), min_size=1, max_size=4).map(tuple),
    host=st.builds(
        HostRequest,
        name=st.none() | names,
        min_cores=st.integers(min_value=0, max_value=512),
        min_memory_bytes=st.integers(min_value=0, max_value=1 << 45),
        selectors=st.lists(selectors, max_size=2).map(tuple),
    ),
)


def _round_trip(value: Any) -> Any:
    text = codec.dumps(value)
    json.loads(text)  # plain JSON
    return codec.loads(text, type(value))


# -- examples of every model type -------------------------------------------------------------------------------

GPU = Device(
    id="pcie0/gpu0",
    fabric="pcie0",
    kind=DeviceKind.GPU,
    serial="SN0",
    vendor="nvidia",
    model="H200",
    switch="pcie0/sw1",
    link_latency_ns=50,
    attributes={"gpu_memory": 141 * GiB, "nvlink": True, "tdp": 700.5, "arch": "hopper"},
    health=Health.DEGRADED,
    failure_domains={"chassis": "c1", "rack": "r1"},
)
MEM = Device(
    id="cxl0/mem0",
    fabric="cxl0",
    kind=DeviceKind.CXL_MEMORY,
    serial="M0",
    capacity=Capacity(4 * GiB),
)
REQUEST = CompositionRequest(
    name="inference",
    host=HostRequest(min_cores=16, min_memory_bytes=256 * GiB, selectors=(Selector("rack", SelectorOp.EQ, "r1"),)),
    resources=(
        ResourceRequest(
            DeviceKind.GPU,
            count=2,
            selectors=(Selector("gpu_memory", SelectorOp.GE, 80 * GiB), Selector("model", SelectorOp.NE, "H100")),
            max_latency_ns=600,
            affinity=Affinity.SAME_SWITCH,
            spread="chassis",
        ),
        ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=512 * GiB),
    ),
)
PLAN = Plan(
    host="h1",
    devices=(DevicePick("pcie0/gpu0", 0, 150), DevicePick("pcie0/gpu1", 0, 150)),
    memory=(MemoryPick("cxl0/pool0", 512 * GiB, 1, 300),),
)
EXAMPLES: list[Any] = [
    Binding("pcie0/gpu0", "h1"),
    Extent(0, GiB),
    Allocation("a1", "cxl0/pool0", "h1", 2 * GiB, (Extent(0, GiB), Extent(4 * GiB, GiB))),
    Selector("model", SelectorOp.EQ, "H200"),
    REQUEST.resources[0],
    REQUEST.host,
    HostRequest(name="h3"),
    REQUEST,
    PLAN.devices[0],
    PLAN.memory[0],
    PLAN,
    Composition(
        id="c1",
        name="inference",
        host="h1",
        state=CompositionState.DEGRADED,
        resources=REQUEST.resources,
        devices=PLAN.devices,
        allocations=(Allocation("c1-m0", "cxl0/pool0", "h1", 512 * GiB, (Extent(0, 512 * GiB),)),),
        generation=7,
        message="1 device unhealthy",
    ),
    PendingChange(
        ChangeKind.ADD, PLAN.devices, (Allocation("c1-m1", "cxl0/pool0", "h1", GiB),), CompositionState.COMPOSED
    ),
    Composition(
        id="c2",
        name="training",
        host="h2",
        state=CompositionState.COMPOSING,
        resources=REQUEST.resources,
        devices=PLAN.devices,
        pending=PendingChange(ChangeKind.REMOVE, PLAN.devices[:1]),
    ),
    PriorState(CompositionState.FAILED, "rollback incomplete"),
    Reservation("r1", REQUEST, PLAN, expires_at=1_700_000_000.25),
    Capacity(4 * GiB),
    GPU,
    MEM,
    Capabilities({DeviceKind.GPU, DeviceKind.NVME}, {Feature.BIND, Feature.UNBIND}, event_latency_s=0.5),
    FabricEvent("pcie0", FabricEventKind.DEVICE_HEALTH, "pcie0/gpu0", Health.FAILED, "xid 79"),
    FabricEvent("pcie0", FabricEventKind.LINK_DOWN, "h1|pcie0/sw1"),
    Event(42, EventType.COMPOSITION_HEALED, "c1", "replaced", 12.5, {"old": "pcie0/gpu0", "new": "pcie0/gpu3"}),
    Port("p1", PortKind.DOWNSTREAM, "pcie0/gpu0", up=False),
    Switch("pcie0/sw1", "pcie0", SwitchKind.CXL, "x", "y", (Port("p0", PortKind.UPSTREAM, "h1"),), {"rack": "r1"}),
    Host("h1", 32, 512 * GiB, "pcie0/sw1", {"rack": "r1", "numa": 2}, {"rack": "r1"}),
    Link("h1", "pcie0/sw1", 100, 64.0, up=False),
    PoolInfo("cxl0/pool0", "cxl0", "cxl0/mem0", Capacity(4 * GiB), PoolKind.MLD, 4),
    Topology(
        fabric="pcie0",
        hosts=(Host("h1", 8, GiB),),
        switches=(Switch("pcie0/sw1", "pcie0"),),
        devices=(GPU, MEM),
        links=(Link("h1", "pcie0/sw1", 100),),
        pools=(PoolInfo("cxl0/pool0", "cxl0", "cxl0/mem0", Capacity(4 * GiB)),),
    ),
]


class TestRoundTrip:
    """codec.loads(codec.dumps(x), type(x)) == x for every model type."""

    @pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
    def test_example(self, value: Any) -> None:
        assert _round_trip(value) == value

    def test_the_state_before_unknown_is_in_the_record_only(self) -> None:
        """A composition's state before UNKNOWN is ledger bookkeeping: kept in its record (the equality of
        compositions leaves it out, so it is compared here), left out of what the CLI prints."""
        unknown = Composition(
            id="c3",
            name="serving",
            host="h1",
            state=CompositionState.UNKNOWN,
            resources=REQUEST.resources,
            message="fabric cxl0 cannot be reached",
            before_unknown=PriorState(CompositionState.DECOMPOSING),
        )
        assert codec.loads(codec.record(unknown), Composition).before_unknown == PriorState(
            CompositionState.DECOMPOSING
        )
        assert "before_unknown" not in codec.to_public_data(unknown)

    def test_every_model_type_has_an_example(self) -> None:
        from disagg import model

        attrs_types = {
            getattr(model, name)
            for name in model.__all__
            if isinstance(getattr(model, name), type) and hasattr(getattr(model, name), "__attrs_attrs__")
        }
        assert attrs_types <= {type(v) for v in EXAMPLES}

    @given(devices)
    def test_device(self, device: Device) -> None:
        assert _round_trip(device) == device

    @given(composition_requests)
    def test_composition_request(self, request: CompositionRequest) -> None:
        assert _round_trip(request) == request

    @given(devices)
    def test_dumps_is_stable(self, device: Device) -> None:
        assert codec.dumps(_round_trip(device)) == codec.dumps(device)

    @pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
    def test_ledger_record(self, value: Any) -> None:
        """`codec.record` (the ledgers' fast encoder) reads back to the same value and the same data as the
        canonical `dumps`."""
        text = codec.record(value)
        assert codec.loads(text, type(value)) == value
        assert json.loads(text) == _unset_left_out(json.loads(codec.dumps(value)))

    @given(devices)
    def test_ledger_record_of_any_device(self, device: Device) -> None:
        assert codec.loads(codec.record(device), Device) == device

    def test_ledger_record_keeps_infinite_floats(self) -> None:
        device = attrs.evolve(GPU, attributes={"max": float("inf"), "min": float("-inf")})
        assert codec.loads(codec.record(device), Device).attributes == {"max": float("inf"), "min": float("-inf")}

    def test_ledger_record_keeps_a_selector_of_nan(self) -> None:
        """orjson writes NaN as null; such a record goes through the standard encoder and reads back as NaN."""
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("score", SelectorOp.GE, float("nan")),))
        text = codec.record(line)
        assert "NaN" in text
        (selector,) = codec.loads(text, ResourceRequest).selectors
        assert isinstance(selector.value, float) and math.isnan(selector.value)


class TestScalarAttributes:
    """Attribute values keep their scalar type (str, int, float, bool) through the codec."""

    @pytest.mark.parametrize(
        "value",
        ["H200", "", "ünïcode", 0, 1, -7, 1 << 62, 0.0, 1.0, -2.5, 1e300, True, False],
        ids=repr,
    )
    def test_type_survives(self, value: Any) -> None:
        loaded = _round_trip(attrs.evolve(GPU, attributes={"v": value}))
        assert loaded.attributes["v"] == value
        assert type(loaded.attributes["v"]) is type(value)

    def test_selector_value_type_survives(self) -> None:
        for value in ("80", 80, 80.0, True):
            loaded = _round_trip(Selector("k", SelectorOp.GE, value))
            assert type(loaded.value) is type(value)

    def test_loaded_mappings_are_read_only(self) -> None:
        loaded = _round_trip(GPU)
        with pytest.raises(TypeError):
            loaded.attributes["x"] = 1
        with pytest.raises(TypeError):
            loaded.failure_domains["x"] = "y"

    def test_non_scalar_attribute_is_refused(self) -> None:
        data = codec.to_data(GPU)
        data["attributes"] = {"bad": [1, 2]}
        with pytest.raises(cattrs.ClassValidationError):
            codec.from_data(data, Device)


class TestToData:
    """to_data gives plain dicts, lists and scalars, with enums as their values."""

    def test_enums_are_values(self) -> None:
        data = codec.to_data(GPU)
        assert data["kind"] == "gpu"
        assert data["health"] == "DEGRADED"
        assert data["attributes"] == {"gpu_memory": 141 * GiB, "nvlink": True, "tdp": 700.5, "arch": "hopper"}
        assert type(data["attributes"]) is dict

    def test_mapping_helper(self) -> None:
        assert codec.mapping({"d": Binding("x", "h"), "n": 3}) == {"d": {"device": "x", "host": "h"}, "n": 3}

    def test_lists_of_values(self) -> None:
        assert codec.to_data([Extent(0, 1), Extent(1, 2)]) == [{"offset": 0, "length": 1}, {"offset": 1, "length": 2}]

    def test_dumps_sorts_keys(self) -> None:
        assert codec.dumps(Extent(5, 6)) == '{"length":6,"offset":5}'


WRITTEN_WHEN_SET = ("equivalent_generations", "generations_before")


def _unset_left_out(data: Any) -> Any:
    """``data`` without the fields of `WRITTEN_WHEN_SET` that hold nothing, as a ledger record leaves them out."""
    if isinstance(data, dict):
        return {k: _unset_left_out(v) for k, v in data.items() if not (k in WRITTEN_WHEN_SET and not v)}
    if isinstance(data, list):
        return [_unset_left_out(v) for v in data]
    return data


class TestFieldsWrittenWhenSet:
    """A rolled-back change's etags (`Composition.equivalent_generations`, `PendingChange.generations_before`) are
    left out of a record while empty, by both of its encoders: the release before refuses a field it does not
    know, and reads every record written without them."""

    @pytest.mark.parametrize("selector", [1.5, math.inf], ids=["orjson", "standard-encoder"])
    def test_left_out_while_empty_and_read_back_when_set(self, selector: float) -> None:
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("j", SelectorOp.NE, selector),))
        pending = PendingChange(ChangeKind.ADD, (), (), CompositionState.COMPOSED)
        comp = Composition("c1", "c", "h1", CompositionState.COMPOSING, (line,), pending=pending)
        text = codec.record(comp)
        assert "equivalent_generations" not in text and "generations_before" not in text
        assert codec.load_record(text, Composition) == comp
        kept = attrs.evolve(
            comp, equivalent_generations=(3, 4), pending=attrs.evolve(pending, generations_before=(3, 4))
        )
        read = codec.load_record(codec.record(kept), Composition)
        assert read.equivalent_generations == (3, 4) and read.pending is not None
        assert read.pending.generations_before == (3, 4)


class TestRequestValuesALedgerMayHold:
    """A record holding a request value a request may no longer give (an earlier version took them) is read back:
    the model classes refused them, and one such record stopped the ledger from loading."""

    def test_a_composition(self) -> None:
        line = ResourceRequest(
            DeviceKind.GPU,
            1,
            selectors=(Selector("k", SelectorOp.NE, 12345678901234567890123), Selector("j", SelectorOp.NE, math.inf)),
            max_latency_ns=10**40,
        )
        comp = Composition("c1", "c", "h1", CompositionState.COMPOSED, (line,))
        assert codec.loads(codec.record(comp), Composition) == comp
        text = codec.record(comp).replace('"value":12345678901234567890123', '"value":-12345678901234567890123')
        (read,) = codec.loads(text, Composition).resources
        assert read.selectors[0].value == -12345678901234567890123

    def test_a_reservation(self) -> None:
        request = CompositionRequest(
            "r",
            (ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=2**70),),
            HostRequest(min_cores=-1, min_memory_bytes=2**64),
        )
        held = Reservation("r1", request, Plan("h1"), 1.0)
        assert codec.loads(codec.record(held), Reservation) == held


class TestAnswerRecords:
    """A Compose's answer, recorded in the hold that recorded its composition, embeds that composition's record as
    written: the same text as an answer built afresh, and the same values read back, an infinite float included."""

    @staticmethod
    def _answer_after_its_composition(comp: Composition) -> tuple[str, str]:
        answer = ComposeResult(ComposeMode.APPLY, PLAN, composition=comp)
        codec.record(attrs.evolve(comp, id="c-other"))  # another composition recorded last: built afresh
        fresh = codec.record(answer)
        codec.record(comp)
        return fresh, codec.record(answer)

    def test_the_same_text_as_built_afresh(self) -> None:
        pending = PendingChange(ChangeKind.ADD, PLAN.devices, (), request_id="q1", fingerprint="f" * 64)
        comp = Composition("c1", "inference", "h1", CompositionState.COMPOSED, REQUEST.resources, pending=pending)
        fresh, embedded = self._answer_after_its_composition(comp)
        assert embedded == fresh
        assert codec.loads(embedded, ComposeResult) == ComposeResult(ComposeMode.APPLY, PLAN, composition=comp)

    def test_an_infinite_selector_value_reads_back(self) -> None:
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("score", SelectorOp.GE, math.inf),))
        comp = Composition("c1", "c", "h1", CompositionState.COMPOSED, (line,))
        fresh, embedded = self._answer_after_its_composition(comp)
        assert json.loads(embedded) == json.loads(fresh)
        read = codec.loads(embedded, ComposeResult).composition
        assert read is not None and read.resources[0].selectors[0].value == math.inf

    def test_records_sharing_a_line_are_written_as_they_are(self) -> None:
        """A line recorded before (the wire layer reads the same bytes as the same line) is written from its
        remembered text: records that share it, alternate with another, or hold an infinite float, are each the
        text of one built with a line of their own."""
        gpu = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("model", SelectorOp.EQ, "H200"),))
        infinite = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("score", SelectorOp.GE, math.inf),))
        for n, line in enumerate([gpu, gpu, REQUEST.resources[1], infinite, infinite, gpu]):
            comp = Composition(f"c{n}", "c", "h1", CompositionState.COMPOSED, (line,))
            afresh = codec.record(attrs.evolve(comp, resources=(attrs.evolve(line),)))
            assert [codec.record(comp), codec.record(comp)] == [afresh, afresh]
            assert codec.loads(afresh, Composition) == comp
