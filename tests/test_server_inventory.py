"""The inventory RPCs over a real server on a unix socket: topology, devices, pools, cordons and drivers, and
the revision each listing is read at."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces.fabric import MAX_ID
from disagg.wire.fabric import event_from_wire
from server_helpers import (
    WAIT_S,
    Churn,
    SecretCapabilities,
    Served,
    compose_request,
    cordons,
    fails,
    gpu,
    serving,
    sim,
    socket_path,
)

pytestmark = pytest.mark.usefixtures("front_end")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack on a unix socket in the test's directory."""
    with serving(socket_path(tmp_path)) as running:
        yield running


GPU = "pcie0/gpu-a0"


def list_all(served: Served, page_size: int, **filters: object) -> list[pb.Device]:
    """Every page of ListDevices, following next_page_token (at most 100 pages)."""
    out: list[pb.Device] = []
    token = ""
    for _ in range(100):
        reply = served.stub.ListDevices(fm.ListDevicesRequest(page_size=page_size, page_token=token, **filters))
        out.extend(reply.devices)
        token = reply.next_page_token
        if not token:
            return out
    raise AssertionError("ListDevices never reached its last page")


class TestGetTopology:
    """GetTopology answers every fabric's topology, with holders, cordons and current health filled in."""

    def test_every_fabric(self, served: Served) -> None:
        reply = served.stub.GetTopology(fm.GetTopologyRequest())
        assert [t.fabric for t in reply.fabrics] == ["pcie0", "cxl0"]
        assert sum(len(t.devices) for t in reply.fabrics) == len(served.composer.devices())
        pcie = reply.fabrics[0]
        assert {h.id for h in pcie.hosts} == {"h1", "h2", "h3", "h4"}
        assert pcie.switches and pcie.links
        assert [p.id for p in reply.fabrics[1].pools] == ["cxl0/mem0", "cxl0/mem1"]

    def test_holders_cordons_and_health(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("one")).composition
        held = comp.devices[0].device
        served.stub.CordonDevice(fm.CordonDeviceRequest(id="pcie0/gpu-b5"))
        served.fabrics["pcie0"].fail_device("pcie0/gpu-b6")  # type: ignore[attr-defined]
        devices = {d.id: d for t in served.stub.GetTopology(fm.GetTopologyRequest()).fabrics for d in t.devices}
        assert devices[held].held_by == comp.id
        assert devices["pcie0/gpu-b5"].cordoned and not devices["pcie0/gpu-b5"].held_by
        assert devices["pcie0/gpu-b6"].health == pb.HEALTH_FAILED
        assert devices["pcie0/gpu-b7"].health == pb.HEALTH_OK and not devices["pcie0/gpu-b7"].cordoned

    def test_revision(self, served: Served) -> None:
        assert served.stub.GetTopology(fm.GetTopologyRequest()).revision == 0
        served.stub.CordonDevice(fm.CordonDeviceRequest(id=GPU))
        assert served.stub.GetTopology(fm.GetTopologyRequest()).revision == served.composer.revision == 1


class TestListDevices:
    """ListDevices filters by kind, fabric, health and freedom, and pages in id order with opaque tokens."""

    def test_pages_cover_every_device_once_in_id_order(self, served: Served) -> None:
        ids = [d.id for d in list_all(served, page_size=7)]
        assert ids == [d.id for d in served.composer.devices()]

    def test_default_page_size_holds_the_rack(self, served: Served) -> None:
        reply = served.stub.ListDevices(fm.ListDevicesRequest())
        assert len(reply.devices) == len(served.composer.devices()) and reply.next_page_token == ""

    def test_exact_last_page_has_no_token(self, served: Served) -> None:
        total = len(served.composer.devices())
        reply = served.stub.ListDevices(fm.ListDevicesRequest(page_size=total))
        assert len(reply.devices) == total and reply.next_page_token == ""

    def test_filters(self, served: Served) -> None:
        nvme = list_all(served, 2, kind=pb.DEVICE_KIND_NVME)
        assert len(nvme) == 4 and {d.kind for d in nvme} == {pb.DEVICE_KIND_NVME}
        assert {d.fabric for d in list_all(served, 5, fabric="cxl0")} == {"cxl0"}
        served.fabrics["pcie0"].fail_device(GPU)  # type: ignore[attr-defined]
        assert [d.id for d in list_all(served, 5, health=pb.HEALTH_FAILED)] == [GPU]

    def test_free_only(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("one", gpu(2))).composition
        served.stub.CordonDevice(fm.CordonDeviceRequest(id="pcie0/gpu-b0"))
        served.fabrics["pcie0"].fail_device("pcie0/gpu-b1")  # type: ignore[attr-defined]
        free = {d.id for d in list_all(served, 3, free_only=True)}
        assert not free & {p.device for p in comp.devices}
        assert not free & {"pcie0/gpu-b0", "pcie0/gpu-b1", "cxl0/cxlmem0", "cxl0/cxlmem1"}
        assert len(free) == 30 - 2 - 1 - 1 - 2

    @pytest.mark.parametrize(
        ("request_fields", "field"),
        [
            ({"kind": 99}, "kind"),
            ({"health": 42}, "health"),
            ({"page_size": 1001}, "page_size"),
            ({"page_token": "not a token"}, "page_token"),
            ({"page_token": "Y29tcG9zaXRpb25zOmE"}, "page_token"),  # a ListCompositions token
            ({"fabric": "two words"}, "fabric"),
        ],
    )
    def test_invalid_argument(self, served: Served, request_fields: dict[str, object], field: str) -> None:
        failed = fails(served.stub.ListDevices, fm.ListDevicesRequest(**request_fields))  # type: ignore[arg-type]
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT
        assert failed.fields == (field,) and failed.reason == "INVALID_REQUEST"

    def test_revision(self, served: Served) -> None:
        first = served.stub.ListDevices(fm.ListDevicesRequest(page_size=5))
        served.stub.CordonDevice(fm.CordonDeviceRequest(id=GPU))
        rest = served.stub.ListDevices(fm.ListDevicesRequest(page_size=5, page_token=first.next_page_token))
        assert (first.revision, rest.revision) == (0, 1) == (0, served.composer.revision)

    def test_list_then_watch_misses_nothing_and_repeats_nothing(self, served: Served) -> None:
        with Churn(served.composer) as churn:
            for _ in range(5):
                churn.wait_for_events(5)
                listed = served.stub.ListDevices(fm.ListDevicesRequest(kind=pb.DEVICE_KIND_GPU))
                stream = served.stub.WatchEvents(fm.WatchEventsRequest(after_revision=listed.revision), timeout=WAIT_S)
                try:
                    churn.wait_for_events(20)
                    later = served.stub.ListDevices(fm.ListDevicesRequest(kind=pb.DEVICE_KIND_GPU))
                    events = [event_from_wire(next(stream).event) for _ in range(later.revision - listed.revision)]
                finally:
                    stream.cancel()
                assert [e.revision for e in events] == list(range(listed.revision + 1, later.revision + 1))
                before = {d.id for d in listed.devices if d.cordoned}
                assert cordons(before, events) == {d.id for d in later.devices if d.cordoned}

    def test_unknown_fabric_is_not_found(self, served: Served) -> None:
        failed = fails(served.stub.ListDevices, fm.ListDevicesRequest(fabric="nope0"))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("fabric", "nope0")


class TestGetDevice:
    """GetDevice answers one device with its holder; an unknown id is NOT_FOUND with ResourceInfo."""

    def test_device_with_holder(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("one")).composition
        device = served.stub.GetDevice(fm.GetDeviceRequest(id=comp.devices[0].device)).device
        assert device.id == comp.devices[0].device and device.held_by == comp.id
        assert device.kind == pb.DEVICE_KIND_GPU and device.fabric == "pcie0" and device.serial

    @pytest.mark.parametrize("bad", ["", "x" * (MAX_ID + 1), "has space"])  # a driver's ids reach MAX_ID
    def test_invalid_id(self, served: Served, bad: str) -> None:
        failed = fails(served.stub.GetDevice, fm.GetDeviceRequest(id=bad))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)

    def test_unknown_device(self, served: Served) -> None:
        failed = fails(served.stub.GetDevice, fm.GetDeviceRequest(id="pcie0/gpu-z9"))
        assert failed.code is grpc.StatusCode.NOT_FOUND
        assert failed.resource == ("device", "pcie0/gpu-z9") and failed.reason == "NOT_FOUND"


class TestListPools:
    """ListPools answers each carved pool with its free bytes, and device use per kind."""

    def test_pools_and_kinds(self, served: Served) -> None:
        request = compose_request("mem", gpu(2), fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=2**39))
        served.stub.Compose(request)
        reply = served.stub.ListPools(fm.ListPoolsRequest())
        assert [p.pool.id for p in reply.pools] == ["cxl0/mem0", "cxl0/mem1"]
        assert all(p.pool.kind == pb.POOL_KIND_DCD and p.pool.capacity.block_bytes == 2**28 for p in reply.pools)
        assert sum(p.pool.capacity.total_bytes - p.free_bytes for p in reply.pools) == 2**39
        kinds = {k.kind: k for k in reply.kinds}
        assert (kinds[pb.DEVICE_KIND_GPU].total, kinds[pb.DEVICE_KIND_GPU].used) == (20, 2)
        assert kinds[pb.DEVICE_KIND_GPU].free == 18 and kinds[pb.DEVICE_KIND_NVME].free == 4
        assert reply.revision == served.composer.revision == 2

    def test_revision_of_an_untouched_rack(self, served: Served) -> None:
        assert served.stub.ListPools(fm.ListPoolsRequest()).revision == 0


class TestCordonDevice:
    """CordonDevice keeps a device out of placement, idempotently, without touching its holder."""

    def test_cordon(self, served: Served) -> None:
        device = served.stub.CordonDevice(fm.CordonDeviceRequest(id=GPU)).device
        assert device.id == GPU and device.cordoned
        assert served.stub.CordonDevice(fm.CordonDeviceRequest(id=GPU)).device.cordoned
        assert served.composer.is_cordoned(GPU)
        assert GPU not in {d.id for d in list_all(served, 50, free_only=True)}

    def test_held_device_keeps_its_holder(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("one")).composition
        device = served.stub.CordonDevice(fm.CordonDeviceRequest(id=comp.devices[0].device)).device
        assert device.cordoned and device.held_by == comp.id

    def test_cordoned_devices_are_not_placed(self, served: Served) -> None:
        for device in served.composer.devices():
            if device.kind.value == "gpu":
                served.stub.CordonDevice(fm.CordonDeviceRequest(id=device.id))
        failed = fails(served.stub.Compose, compose_request("none"))
        assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "NO_FIT"

    def test_invalid_id(self, served: Served) -> None:
        failed = fails(served.stub.CordonDevice, fm.CordonDeviceRequest())
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)

    def test_unknown_device(self, served: Served) -> None:
        failed = fails(served.stub.CordonDevice, fm.CordonDeviceRequest(id="pcie0/nope"))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("device", "pcie0/nope")


class TestUncordonDevice:
    """UncordonDevice offers a cordoned device to placement again, idempotently."""

    def test_uncordon(self, served: Served) -> None:
        served.stub.CordonDevice(fm.CordonDeviceRequest(id=GPU))
        device = served.stub.UncordonDevice(fm.UncordonDeviceRequest(id=GPU)).device
        assert not device.cordoned and not served.composer.is_cordoned(GPU)
        assert not served.stub.UncordonDevice(fm.UncordonDeviceRequest(id=GPU)).device.cordoned
        assert GPU in {d.id for d in list_all(served, 50, free_only=True)}

    def test_invalid_id(self, served: Served) -> None:
        failed = fails(served.stub.UncordonDevice, fm.UncordonDeviceRequest(id="a\tb"))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)

    def test_unknown_device(self, served: Served) -> None:
        failed = fails(served.stub.UncordonDevice, fm.UncordonDeviceRequest(id="cxl0/nope"))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("device", "cxl0/nope")


class TestListDrivers:
    """ListDrivers answers each loaded fabric with its driver, plugin, distribution, version and capabilities."""

    def test_fabrics(self, served: Served) -> None:
        fabrics = served.stub.ListDrivers(fm.ListDriversRequest()).fabrics
        assert [(f.name, f.driver, f.plugin, f.distribution, f.version) for f in fabrics] == [
            ("pcie0", "sim", "sim", "disagg-sim", "test"),
            ("cxl0", "sim", "sim", "disagg-sim", "test"),
        ]
        caps = fabrics[0].capabilities
        assert pb.FEATURE_BIND in caps.features and pb.DEVICE_KIND_GPU in caps.kinds and caps.event_latency_s > 0

    def test_unexpected_failure_is_internal_without_its_text(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        fabrics = {"pcie0": sim(SecretCapabilities)}
        with serving(socket_path(tmp_path), fabrics) as served:
            failed = fails(served.stub.ListDrivers, fm.ListDriversRequest())
        assert failed.code is grpc.StatusCode.INTERNAL and failed.reason == "INTERNAL"
        assert "secret" not in failed.message and "RuntimeError" not in failed.message
        incident = failed.metadata["incident"]
        assert incident in failed.message
        assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)
        assert "secret capability text" in caplog.text
