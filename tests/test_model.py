"""Unit tests of the frozen model values in `disagg.model`."""

from __future__ import annotations

import attrs
import pytest
from disagg.model import (
    CXL_DC_BLOCK_BYTES,
    Capacity,
    ChangeKind,
    Composition,
    CompositionRequest,
    CompositionState,
    Device,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    Host,
    HostRequest,
    PendingChange,
    PoolInfo,
    PoolKind,
    ResourceRequest,
    Selector,
    SelectorOp,
    Switch,
    device_id,
)
from disagg.model.composition import request_limit_refusal, revise, selector_value_refusal

GiB = 1 << 30
MiB = 1 << 20


def _gpu(**kw: object) -> Device:
    fields: dict[str, object] = {"id": "pcie0/gpu0", "fabric": "pcie0", "kind": DeviceKind.GPU, "serial": "SN-0"}
    fields.update(kw)
    return Device(**fields)  # type: ignore[arg-type]


class TestDeviceKindParse:
    """DeviceKind.parse accepts a kind's value, its name or a short alias, and names the known kinds otherwise."""

    @pytest.mark.parametrize("kind", list(DeviceKind))
    def test_value(self, kind: DeviceKind) -> None:
        assert DeviceKind.parse(kind.value) is kind

    @pytest.mark.parametrize("kind", list(DeviceKind))
    def test_name(self, kind: DeviceKind) -> None:
        assert DeviceKind.parse(kind.name) is kind

    @pytest.mark.parametrize(
        ("text", "kind"),
        [
            ("cxl", DeviceKind.CXL_MEMORY),
            ("mem", DeviceKind.CXL_MEMORY),
            ("memory", DeviceKind.CXL_MEMORY),
            ("ssd", DeviceKind.NVME),
            ("  Gpu  ", DeviceKind.GPU),
            ("CXL", DeviceKind.CXL_MEMORY),
            ("cxl_memory", DeviceKind.CXL_MEMORY),
        ],
    )
    def test_alias_case_and_spaces(self, text: str, kind: DeviceKind) -> None:
        assert DeviceKind.parse(text) is kind

    @pytest.mark.parametrize("text", ["tpu", "", "gpus", "cxl-mem"])
    def test_unknown_lists_known_kinds(self, text: str) -> None:
        with pytest.raises(ValueError, match="unknown device kind") as info:
            DeviceKind.parse(text)
        message = str(info.value)
        assert repr(text) in message
        for kind in DeviceKind:
            assert kind.value in message


class TestCapacity:
    """Capacity is a non-negative whole number of positive-sized blocks, and rounds amounts up to blocks."""

    def test_default_block_is_cxl_dc_block(self) -> None:
        cap = Capacity(4 * GiB)
        assert cap.block_bytes == CXL_DC_BLOCK_BYTES == 256 * MiB
        assert cap.blocks == 16

    def test_zero_is_valid(self) -> None:
        assert Capacity(0).blocks == 0

    @pytest.mark.parametrize("total", [-CXL_DC_BLOCK_BYTES, 1, CXL_DC_BLOCK_BYTES + 1, GiB + MiB])
    def test_not_a_multiple_or_negative(self, total: int) -> None:
        with pytest.raises(ValueError, match="not a non-negative multiple"):
            Capacity(total)

    @pytest.mark.parametrize("block", [0, -1, -CXL_DC_BLOCK_BYTES])
    def test_block_must_be_positive(self, block: int) -> None:
        with pytest.raises(ValueError, match="block_bytes must be positive"):
            Capacity(0, block_bytes=block)

    @pytest.mark.parametrize(
        ("amount", "carved"),
        [
            (0, 0),
            (1, 256 * MiB),
            (256 * MiB - 1, 256 * MiB),
            (256 * MiB, 256 * MiB),
            (256 * MiB + 1, 512 * MiB),
            (GiB, GiB),
            (300 * MiB, 512 * MiB),
        ],
    )
    def test_round_up(self, amount: int, carved: int) -> None:
        assert Capacity(4 * GiB).round_up(amount) == carved

    def test_round_up_uses_own_block_size(self) -> None:
        cap = Capacity(4 * GiB, block_bytes=GiB)
        assert cap.blocks == 4
        assert cap.round_up(1) == GiB
        assert cap.round_up(GiB + 1) == 2 * GiB


class TestPoolInfo:
    """An MLD pool has 1 to 16 logical devices, or 0 when not reported (read as 16); a DCD has none."""

    @pytest.mark.parametrize(("lds", "count"), [(0, 16), (1, 1), (4, 4), (16, 16)])
    def test_an_mld_holds_one_allocation_per_logical_device(self, lds: int, count: int) -> None:
        assert PoolInfo("cxl0/p", "cxl0", "cxl0/mem0", Capacity(GiB), PoolKind.MLD, lds).ld_count == count

    def test_a_dcd_holds_any_number(self) -> None:
        assert PoolInfo("cxl0/p", "cxl0", "cxl0/mem0", Capacity(GiB)).ld_count is None

    @pytest.mark.parametrize("lds", [17, -1, 1 << 16])
    def test_more_than_an_mld_has(self, lds: int) -> None:
        with pytest.raises(ValueError, match=f"pool cxl0/p is an MLD of {lds} logical devices; an MLD has 1 to 16"):
            PoolInfo("cxl0/p", "cxl0", "cxl0/mem0", Capacity(GiB), PoolKind.MLD, lds)

    def test_a_dcd_has_no_logical_devices(self) -> None:
        with pytest.raises(ValueError, match="pool cxl0/p is a dcd pool, which has no logical devices, not 4"):
            PoolInfo("cxl0/p", "cxl0", "cxl0/mem0", Capacity(GiB), PoolKind.DCD, 4)


class TestDeviceAttribute:
    """Device.attribute looks up vendor, model, serial and kind as fields first, then the attributes."""

    def test_fixed_fields(self) -> None:
        dev = _gpu(vendor="nvidia", model="H200", serial="SN-9")
        assert dev.attribute("vendor") == "nvidia"
        assert dev.attribute("model") == "H200"
        assert dev.attribute("serial") == "SN-9"
        assert dev.attribute("kind") == "gpu"

    def test_fixed_fields_win_over_attributes(self) -> None:
        dev = _gpu(model="H200", attributes={"model": "fake", "vendor": "fake", "kind": "fake", "serial": "x"})
        assert dev.attribute("model") == "H200"
        assert dev.attribute("vendor") == ""
        assert dev.attribute("kind") == "gpu"
        assert dev.attribute("serial") == "SN-0"

    def test_attributes(self) -> None:
        dev = _gpu(attributes={"gpu_memory": 80 * GiB, "nvlink": True, "tdp": 700.5, "arch": "hopper"})
        assert dev.attribute("gpu_memory") == 80 * GiB
        assert dev.attribute("nvlink") is True
        assert dev.attribute("tdp") == 700.5
        assert dev.attribute("arch") == "hopper"

    def test_missing_attribute_is_none(self) -> None:
        assert _gpu(attributes={"a": 1}).attribute("b") is None

    def test_local_id(self) -> None:
        assert _gpu(id="pcie0/chassis1/gpu3").local_id == "chassis1/gpu3"
        assert _gpu(id="bare").local_id == "bare"


class TestDeviceId:
    """device_id joins a fabric name and a local id with '/', refusing empty parts and a '/' in the fabric."""

    def test_join(self) -> None:
        assert device_id("pcie0", "gpu3") == "pcie0/gpu3"

    def test_local_id_may_contain_slash(self) -> None:
        assert device_id("pcie0", "c1/gpu3") == "pcie0/c1/gpu3"

    @pytest.mark.parametrize("fabric", ["", "a/b", "/"])
    def test_bad_fabric(self, fabric: str) -> None:
        with pytest.raises(ValueError, match="invalid fabric name"):
            device_id(fabric, "gpu0")

    def test_empty_local_id(self) -> None:
        with pytest.raises(ValueError, match="empty device id"):
            device_id("pcie0", "")


class TestResourceRequest:
    """A resource line has a count xor an amount, amounts only for cxl-memory, and nothing negative."""

    def test_count(self) -> None:
        r = ResourceRequest(DeviceKind.GPU, count=8)
        assert (r.count, r.amount_bytes, r.carved) == (8, 0, False)

    def test_amount_of_cxl_memory(self) -> None:
        r = ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=GiB)
        assert r.carved

    def test_count_of_cxl_memory_devices(self) -> None:
        assert not ResourceRequest(DeviceKind.CXL_MEMORY, count=2).carved

    @pytest.mark.parametrize(("count", "amount"), [(0, 0), (1, GiB)])
    def test_count_xor_amount(self, count: int, amount: int) -> None:
        with pytest.raises(ValueError, match="exactly one of a count or an amount"):
            ResourceRequest(DeviceKind.CXL_MEMORY, count=count, amount_bytes=amount)

    @pytest.mark.parametrize("kind", [k for k in DeviceKind if k is not DeviceKind.CXL_MEMORY])
    def test_amount_only_for_cxl_memory(self, kind: DeviceKind) -> None:
        with pytest.raises(ValueError, match=f"only be carved from cxl-memory, not {kind.value}"):
            ResourceRequest(kind, amount_bytes=GiB)

    @pytest.mark.parametrize(
        ("count", "amount"),
        [(-1, GiB), (2, -GiB), (-1, 0), (0, -GiB)],
    )
    def test_negative(self, count: int, amount: int) -> None:
        with pytest.raises(ValueError):
            ResourceRequest(DeviceKind.CXL_MEMORY, count=count, amount_bytes=amount)

    def test_negative_latency(self) -> None:
        with pytest.raises(ValueError, match="latency must not be negative"):
            ResourceRequest(DeviceKind.GPU, count=1, max_latency_ns=-1)

    def test_zero_latency_is_allowed(self) -> None:
        assert ResourceRequest(DeviceKind.GPU, count=1, max_latency_ns=0).max_latency_ns == 0

    def test_matches_all_selectors(self) -> None:
        r = ResourceRequest(
            DeviceKind.GPU,
            count=1,
            selectors=(Selector("model", SelectorOp.EQ, "H200"), Selector("gpu_memory", SelectorOp.GE, 80 * GiB)),
        )
        assert r.matches(_gpu(model="H200", attributes={"gpu_memory": 141 * GiB}).attribute)
        assert not r.matches(_gpu(model="H200", attributes={"gpu_memory": 40 * GiB}).attribute)
        assert not r.matches(_gpu(model="H100", attributes={"gpu_memory": 141 * GiB}).attribute)


class TestWireLimits:
    """A request's numbers are held to the proto fields that carry them, so that a request the local composer takes
    (built in Python, from text or from a document) is one a client can send to a server."""

    def test_the_limits_are_the_proto_field_types(self) -> None:
        from disagg.fabric.v1 import fabric_manager_pb2 as fm
        from disagg.fabric.v1 import types_pb2 as pb
        from disagg.model.composition import MAX_BYTES, MAX_COUNT, MAX_LATENCY_NS, SELECTOR_INT_RANGE
        from google.protobuf.descriptor import FieldDescriptor as F

        def kind(message: object, name: str) -> int:
            return int(message.DESCRIPTOR.fields_by_name[name].type)  # type: ignore[attr-defined]

        bits = {F.TYPE_UINT32: range(2**32), F.TYPE_UINT64: range(2**64), F.TYPE_INT64: range(-(2**63), 2**63)}
        assert bits[kind(fm.ResourceRequest, "count")] == range(MAX_COUNT + 1)
        assert bits[kind(fm.HostRequest, "min_cores")] == range(MAX_COUNT + 1)
        assert bits[kind(fm.ResourceRequest, "amount_bytes")] == range(MAX_BYTES + 1)
        assert bits[kind(fm.HostRequest, "min_memory_bytes")] == range(MAX_BYTES + 1)
        assert bits[kind(fm.ResourceRequest, "max_latency_ns")] == range(MAX_LATENCY_NS + 1)
        assert bits[kind(pb.AttributeValue, "int_value")] == SELECTOR_INT_RANGE

    @pytest.mark.parametrize(
        ("fields", "field", "message"),
        [
            ({"kind": DeviceKind.GPU, "count": 2**32}, "resources[0].count", "a count of 4294967296 is more than"),
            ({"kind": DeviceKind.CXL_MEMORY, "amount_bytes": 2**64}, "resources[0].amount_bytes", "an amount of"),
            ({"kind": DeviceKind.GPU, "count": 1, "max_latency_ns": 2**64}, "resources[0].max_latency_ns", "latency"),
        ],
    )
    def test_resource_request(self, fields: dict[str, object], field: str, message: str) -> None:
        """The model takes it (a ledger may hold it); a request may not."""
        line = ResourceRequest(**fields)  # type: ignore[arg-type]
        refusal = request_limit_refusal((line,))
        assert refusal is not None and refusal[0] == field and message in refusal[1]
        added = request_limit_refusal((ResourceRequest(DeviceKind.GPU, 1), line), field="add")
        assert added == (field.replace("resources[0]", "add[1]"), refusal[1])

    def test_resource_request_at_the_limits(self) -> None:
        at = (
            ResourceRequest(DeviceKind.GPU, count=2**32 - 1, max_latency_ns=2**64 - 1),
            ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=2**64 - 1),
        )
        assert request_limit_refusal(at, HostRequest(min_cores=2**32 - 1, min_memory_bytes=2**64 - 1)) is None

    @pytest.mark.parametrize(
        ("fields", "field", "message"),
        [
            ({"min_cores": 2**32}, "host.min_cores", "more than the most a request may give"),
            ({"min_memory_bytes": 2**64}, "host.min_memory_bytes", "more than the most a request may give"),
            ({"min_cores": -1}, "host.min_cores", "must not be negative"),
            ({"min_memory_bytes": -1}, "host.min_memory_bytes", "must not be negative"),
            ({"selectors": (Selector("k", SelectorOp.GE, 2**63),)}, "host.selectors[0].value", "beyond the whole"),
        ],
    )
    def test_host_request(self, fields: dict[str, object], field: str, message: str) -> None:
        host = HostRequest(**fields)  # type: ignore[arg-type]
        refusal = request_limit_refusal((ResourceRequest(DeviceKind.GPU, 1),), host)
        assert refusal is not None and refusal[0] == field and message in refusal[1]

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            (2**63, "beyond the whole numbers"),
            (-(2**63) - 1, "beyond the whole numbers"),
            (10**30, "beyond the whole numbers"),
            (float("inf"), "not a number a device can have"),
            (float("-inf"), "not a number a device can have"),
            (float("nan"), "not a number a device can have"),
            ("x" * 257, "text of at most 256 characters"),
        ],
    )
    def test_selector(self, value: int | float | str, message: str) -> None:
        line = ResourceRequest(
            DeviceKind.GPU, 1, selectors=(Selector("j", SelectorOp.EQ, 1), Selector("k", SelectorOp.GE, value))
        )
        refusal = request_limit_refusal((line,))
        assert refusal is not None and refusal[0] == "resources[0].selectors[1].value" and message in refusal[1]
        assert selector_value_refusal(value) == refusal[1]

    @pytest.mark.parametrize("value", [2**63 - 1, -(2**63), 1.5, True, "x" * 256])
    def test_selector_in_range(self, value: int | float | bool | str) -> None:
        assert Selector("k", SelectorOp.GE, value).value == value
        assert selector_value_refusal(value) == ""


class TestTheModelTakesWhatALedgerHolds:
    """The model classes take values a request may not hold: the ledger rebuilds them from records an earlier
    version wrote (which took any of these), and one that raised made every command and `disagg serve` fail."""

    @pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30, 10**400, float("inf"), float("-inf"), float("nan")])
    def test_selector(self, value: int | float) -> None:
        assert Selector("k", SelectorOp.NE, value).value is value

    @pytest.mark.parametrize(
        "fields",
        [
            {"kind": DeviceKind.GPU, "count": 2**32},
            {"kind": DeviceKind.CXL_MEMORY, "amount_bytes": 2**64},
            {"kind": DeviceKind.GPU, "count": 1, "max_latency_ns": 10**40},
        ],
    )
    def test_resource_request(self, fields: dict[str, object]) -> None:
        assert ResourceRequest(**fields).kind is fields["kind"]  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "fields", [{"min_cores": 2**32}, {"min_memory_bytes": 2**64}, {"min_cores": -1}, {"min_memory_bytes": -1}]
    )
    def test_host_request(self, fields: dict[str, int]) -> None:
        assert attrs.asdict(HostRequest(**fields)).items() >= fields.items()  # type: ignore[arg-type]

    def test_the_checks_it_had_before_stay(self) -> None:
        with pytest.raises(ValueError, match="must not be negative"):
            ResourceRequest(DeviceKind.CXL_MEMORY, count=-1, amount_bytes=1)
        with pytest.raises(ValueError, match="max latency must not be negative"):
            ResourceRequest(DeviceKind.GPU, count=1, max_latency_ns=-1)


class TestCompositionRequest:
    """A composition request needs a name and at least one resource; its host defaults to any host."""

    def test_valid(self) -> None:
        req = CompositionRequest("train", (ResourceRequest(DeviceKind.GPU, count=1),))
        assert req.host == HostRequest()
        assert req.host.name is None

    def test_needs_name(self) -> None:
        with pytest.raises(ValueError, match="needs a name"):
            CompositionRequest("", (ResourceRequest(DeviceKind.GPU, count=1),))

    def test_needs_resources(self) -> None:
        with pytest.raises(ValueError, match="at least one resource"):
            CompositionRequest("train", ())


class TestSelectorMatches:
    """Selector.matches compares with its operator, strings without case for = and !=, and a mismatch only for !=."""

    @pytest.mark.parametrize(
        ("op", "value", "actual", "expected"),
        [
            (SelectorOp.EQ, 80, 80, True),
            (SelectorOp.EQ, 80, 81, False),
            (SelectorOp.NE, 80, 81, True),
            (SelectorOp.NE, 80, 80, False),
            (SelectorOp.GE, 80, 80, True),
            (SelectorOp.GE, 80, 79, False),
            (SelectorOp.LE, 80, 80, True),
            (SelectorOp.LE, 80, 81, False),
            (SelectorOp.GT, 80, 81, True),
            (SelectorOp.GT, 80, 80, False),
            (SelectorOp.LT, 80, 79, True),
            (SelectorOp.LT, 80, 80, False),
            (SelectorOp.GE, 80, 80.5, True),
            (SelectorOp.LT, 1.5, 1, True),
            (SelectorOp.EQ, True, True, True),
            (SelectorOp.EQ, True, False, False),
        ],
    )
    def test_operators(self, op: SelectorOp, value: object, actual: object, expected: bool) -> None:
        assert Selector("k", op, value).matches(actual) is expected  # type: ignore[arg-type]

    @pytest.mark.parametrize(("actual", "expected"), [("H200", True), ("h200", True), ("H100", False)])
    def test_eq_strings_ignore_case(self, actual: str, expected: bool) -> None:
        assert Selector("model", SelectorOp.EQ, "H200").matches(actual) is expected

    @pytest.mark.parametrize(("actual", "expected"), [("H200", False), ("h200", False), ("H100", True)])
    def test_ne_strings_ignore_case(self, actual: str, expected: bool) -> None:
        assert Selector("model", SelectorOp.NE, "h200").matches(actual) is expected

    def test_ordered_string_comparison(self) -> None:
        assert Selector("gen", SelectorOp.GE, "b").matches("c")
        assert not Selector("gen", SelectorOp.GE, "b").matches("a")

    @pytest.mark.parametrize("op", list(SelectorOp))
    def test_missing_attribute(self, op: SelectorOp) -> None:
        assert Selector("rack", op, "r1").matches(None) is (op is SelectorOp.NE)

    @pytest.mark.parametrize("op", list(SelectorOp))
    def test_string_selector_against_number(self, op: SelectorOp) -> None:
        assert Selector("gpu_memory", op, "big").matches(80) is (op is SelectorOp.NE)

    @pytest.mark.parametrize("op", list(SelectorOp))
    def test_number_selector_against_string(self, op: SelectorOp) -> None:
        assert Selector("gpu_memory", op, 80).matches("80") is (op is SelectorOp.NE)

    def test_str(self) -> None:
        assert str(Selector("gpu_memory", SelectorOp.GE, 80)) == "gpu_memory>=80"


class TestCompositionEtag:
    """A composition's etag is a weak etag of its id and generation: it changes whenever the generation does, and
    two compositions never share one."""

    def _composition(self, generation: int = 1) -> Composition:
        return Composition(
            id="c1",
            name="train",
            host="h1",
            state=CompositionState.COMPOSED,
            resources=(ResourceRequest(DeviceKind.GPU, count=2),),
            devices=(DevicePick("pcie0/g0", 0, 100), DevicePick("pcie0/g1", 0, 100)),
            generation=generation,
        )

    def test_format(self) -> None:
        assert self._composition().etag == 'W/"c1.1"'

    def test_another_composition_at_the_same_generation_differs(self) -> None:
        assert attrs.evolve(self._composition(), id="c2").etag != self._composition().etag

    def test_changes_with_generation(self) -> None:
        first = self._composition()
        second = attrs.evolve(first, generation=first.generation + 1)
        assert second.etag == 'W/"c1.2"'
        assert first.etag != second.etag

    def test_device_ids(self) -> None:
        assert self._composition().device_ids == ("pcie0/g0", "pcie0/g1")


class TestFrozenValues:
    """Model values cannot be changed in place: fields refuse assignment and mappings are read-only copies."""

    def test_assigning_a_field_raises(self) -> None:
        dev = _gpu()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            dev.model = "H100"  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            Capacity(0).total_bytes = 1  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            Selector("a", SelectorOp.EQ, 1).value = 2  # type: ignore[misc]

    def test_device_mappings_are_read_only(self) -> None:
        dev = _gpu(attributes={"a": 1}, failure_domains={"chassis": "c1"})
        with pytest.raises(TypeError):
            dev.attributes["a"] = 2  # type: ignore[index]
        with pytest.raises(TypeError):
            dev.failure_domains["chassis"] = "c2"  # type: ignore[index]
        assert dev.attributes["a"] == 1

    def test_other_mappings_are_read_only(self) -> None:
        host = Host("h1", attributes={"rack": "r1"}, failure_domains={"rack": "r1"})
        switch = Switch("pcie0/sw1", "pcie0", failure_domains={"rack": "r1"})
        event = Event(1, EventType.DEVICE_ADDED, "pcie0/g0", data={"k": "v"})
        for mapping in (host.attributes, host.failure_domains, switch.failure_domains, event.data):
            with pytest.raises(TypeError):
                mapping["x"] = "y"  # type: ignore[index]

    def test_mappings_are_copied(self) -> None:
        attributes: dict[str, object] = {"a": 1}
        dev = _gpu(attributes=attributes)
        attributes["a"] = 2
        attributes["b"] = 3
        assert dict(dev.attributes) == {"a": 1}

    def test_evolve_leaves_original(self) -> None:
        dev = _gpu(model="H200")
        changed = attrs.evolve(dev, model="H100")
        assert (dev.model, changed.model) == ("H200", "H100")


class TestRevise:
    """`revise` is ``attrs.evolve`` for a composition, field for field, and refuses a field it does not have."""

    def _comp(self) -> Composition:
        return Composition(
            id="c-1",
            name="train",
            host="h1",
            state=CompositionState.COMPOSING,
            resources=(ResourceRequest(DeviceKind.GPU, 1),),
            devices=(DevicePick("pcie0/g0", 0, 100),),
            request_id="r-1",
            request_fingerprint="fp",
        )

    @pytest.mark.parametrize(
        "changes",
        [
            {},
            {"state": CompositionState.COMPOSED, "generation": 2},
            {"devices": (), "message": "gone", "pending": None},
            {"request_id": "r-2", "request_fingerprint": "fp2", "before_unknown": None},
            {"pending": PendingChange(ChangeKind.ADD, (DevicePick("pcie0/g1", 0, 100),)), "generation": 3},
        ],
        ids=["nothing", "state", "devices", "bookkeeping", "pending"],
    )
    def test_same_as_evolve(self, changes: dict[str, object]) -> None:
        comp = self._comp()
        new = revise(comp, **changes)
        assert new is not comp
        for field in attrs.fields(Composition):  # eq=False fields too: compare every one
            assert getattr(new, field.name) == getattr(attrs.evolve(comp, **changes), field.name), field.name
        assert comp.state is CompositionState.COMPOSING and comp.generation == 1

    def test_unknown_field(self) -> None:
        with pytest.raises(TypeError, match="Composition has no field 'colour'"):
            revise(self._comp(), colour="red")


class TestALabelOfManyDigits:
    """A failure-domain label of more digits than Python reads as an int (4300) crashed placement with its
    ValueError (`Device.attribute`): it is read as text, and matches a selector that compares with that text."""

    @pytest.mark.parametrize(
        "label", ["9" * 5000, "-" + "9" * 5000, "9" * 5000 + "GiB", "1." + "9" * 5000 + "KiB", "1.0001KiB"]
    )
    def test_read_as_text(self, label: str) -> None:
        dev = _gpu(failure_domains={"rack": label})
        assert dev.attribute("rack") == label
        assert Selector("rack", SelectorOp.EQ, label).matches(dev.attribute("rack"))
        assert not Selector("rack", SelectorOp.EQ, 1).matches(dev.attribute("rack"))
        host = Host("h1", 8, 1 << 30, failure_domains={"rack": label})
        assert host.attribute("rack") == label

    def test_at_the_limit_a_number(self) -> None:
        assert _gpu(failure_domains={"rack": "9" * 4300}).attribute("rack") == int("9" * 4300)
