"""The composer carries a caller's deadline to its drivers (never into a rollback), and applies a reservation
once per request id."""

from __future__ import annotations

import threading
import time

import pytest
from composer_helpers import composer, hardware_bindings, rack
from disagg.errors import DeadlineExceededError, NotFoundError, RequestIdReusedError
from disagg.interfaces import CallContext
from disagg.model import Binding, ComposeMode
from disagg.requestlang import parse_request, parse_resource
from disagg_sim import SimFabric, create_fabric, load_topology
from server_helpers import wait_until

TWO_GPUS = parse_request("job", ["gpu x2"])


class Recording(SimFabric):
    """A sim fabric that records the deadline of every bind and unbind, and can fail the second bind."""

    calls: list[tuple[str, float | None]]
    fail_second_bind: bool = False

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.calls.append(("bind", ctx.deadline))
        if self.fail_second_bind and sum(1 for c, _ in self.calls if c == "bind") == 2:
            raise DeadlineExceededError("the hardware took too long")
        return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        self.calls.append(("unbind", ctx.deadline))
        super().unbind(binding, ctx)


def recording_rack() -> dict[str, SimFabric]:
    pcie = Recording(load_topology("pcie0", "demo-pcie"))
    pcie.calls = []
    return {"pcie0": pcie, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}


class TestDeadlines:
    """Driver calls carry the earlier of the call timeout and the caller's deadline; a rollback only the former."""

    def test_without_deadline_the_call_timeout(self) -> None:
        fabrics = recording_rack()
        before = time.monotonic()
        composer(fabrics, call_timeout_s=30.0).compose(TWO_GPUS)
        deadlines = [d for _, d in fabrics["pcie0"].calls]  # type: ignore[attr-defined]
        assert len(deadlines) == 2 and all(d is not None and before + 29 < d < time.monotonic() + 31 for d in deadlines)

    def test_earlier_deadline_wins(self) -> None:
        fabrics = recording_rack()
        deadline = time.monotonic() + 5.0
        comp = composer(fabrics, call_timeout_s=30.0)
        created = comp.compose(TWO_GPUS, deadline=deadline).composition
        assert created is not None
        comp.recompose(created.id, add=[parse_resource("gpu x1")], deadline=deadline)
        comp.decompose(created.id, deadline=deadline)
        calls = fabrics["pcie0"].calls  # type: ignore[attr-defined]
        assert [c for c, _ in calls] == ["bind"] * 3 + ["unbind"] * 3
        assert all(d == deadline for _, d in calls)

    def test_later_deadline_is_cut_to_the_call_timeout(self) -> None:
        fabrics = recording_rack()
        composer(fabrics, call_timeout_s=1.0).compose(TWO_GPUS, deadline=time.monotonic() + 3600)
        assert all(d is not None and d < time.monotonic() + 2 for _, d in fabrics["pcie0"].calls)  # type: ignore[attr-defined]

    def test_rollback_is_not_bound_by_the_deadline(self) -> None:
        fabrics = recording_rack()
        fabrics["pcie0"].fail_second_bind = True  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5.0
        comp = composer(fabrics, call_timeout_s=30.0)
        with pytest.raises(DeadlineExceededError):
            comp.compose(TWO_GPUS, deadline=deadline)
        calls = fabrics["pcie0"].calls  # type: ignore[attr-defined]
        assert [c for c, _ in calls] == ["bind", "bind", "unbind"]
        assert calls[2][1] is not None and calls[2][1] > deadline + 20
        assert hardware_bindings(fabrics) == {} and comp.compositions() == []


class TestAWaitPastTheDeadline:
    """A change that waited for another change of its composition until its caller's deadline passed changes
    nothing: it ran on after the caller had left, failed its driver calls, rolled back, and left a newer etag
    and its events behind, so that other clients' guarded updates were refused for nothing."""

    @pytest.mark.parametrize("second", ["recompose", "decompose"])
    def test_it_changes_nothing(self, second: str) -> None:
        comp = composer(rack(pcie0={"bind_delay_s": 0.6}))
        made = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert made is not None
        first = threading.Thread(target=lambda: comp.recompose(made.id, add=[parse_resource("gpu x1")]))
        first.start()
        wait_until(lambda: comp.get(made.id).pending is not None, "the first change to hold the composition")
        with pytest.raises(DeadlineExceededError, match="waited for another change"):
            if second == "recompose":
                comp.recompose(made.id, add=[parse_resource("gpu x1")], deadline=time.monotonic() + 0.1)
            else:
                comp.decompose(made.id, deadline=time.monotonic() + 0.1)
        first.join(5)
        revision, grown = comp.revision, comp.get(made.id)
        assert len(grown.devices) == 2
        time.sleep(0.3)
        assert comp.revision == revision and comp.get(made.id) == grown
        assert comp.get(made.id).etag == grown.etag


class TestApplyReserved:
    """Applying a reservation answers the plan and the composition, once per request id."""

    def test_plan_and_composition(self) -> None:
        comp = composer()
        reservation = comp.compose(TWO_GPUS, ComposeMode.RESERVE).reservation
        assert reservation is not None
        result = comp.apply_reserved(reservation.id)
        assert result.mode is ComposeMode.APPLY and result.plan == reservation.plan
        assert result.composition is not None and result.composition.device_ids == tuple(
            p.device for p in reservation.plan.devices
        )

    def test_retry_with_request_id(self) -> None:
        comp = composer()
        reservation = comp.compose(TWO_GPUS, ComposeMode.RESERVE).reservation
        assert reservation is not None
        first = comp.apply_reservation(reservation.id, request_id="a-1")
        assert comp.apply_reservation(reservation.id, request_id="a-1") == first
        with pytest.raises(NotFoundError):
            comp.apply_reservation(reservation.id)
        with pytest.raises(RequestIdReusedError):
            comp.compose(parse_request("other", ["gpu x1"]), request_id="a-1")
