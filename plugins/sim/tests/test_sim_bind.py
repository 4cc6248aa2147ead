"""Whole-device binding: idempotent, fenced, and refused with the SDK's error for every bad case."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import (
    DeadlineExceededError,
    DeviceBusyError,
    FabricUnavailableError,
    HostUnreachableError,
    InvalidRequestError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
)
from disagg.interfaces import CallContext, Fabric, FaultInjection
from disagg.interfaces import Device as DeviceHandle
from disagg.model import Binding, DeviceKind, Feature, Health
from disagg_sim import SIM_CAPABILITIES, SimFabric, load_topology
from sim_helpers import in_its_delay

GPU = "pcie/gpu-a0"


class TestInterfaces:
    """A SimFabric is a Fabric with fault injection and declares every kind and feature."""

    def test_implements_the_interfaces(self, pcie: SimFabric) -> None:
        assert isinstance(pcie, Fabric) and isinstance(pcie, FaultInjection)
        assert pcie.name == "pcie"
        assert pcie.capabilities() == SIM_CAPABILITIES
        assert SIM_CAPABILITIES.kinds == frozenset(DeviceKind)
        assert SIM_CAPABILITIES.features == {
            Feature.BIND,
            Feature.UNBIND,
            Feature.CARVE,
            Feature.HEALTH_EVENTS,
            Feature.SANITIZE,
            Feature.FENCING,
            Feature.FAULT_INJECTION,
        }
        assert SIM_CAPABILITIES.event_latency_s == 0.1


class TestBind:
    """bind attaches a device to a host once; repeating it returns the same binding and changes nothing."""

    def test_bind_and_bindings(self, pcie: SimFabric, ctx: CallContext) -> None:
        assert pcie.bindings() == ()
        assert pcie.bind(GPU, "h1", ctx) == Binding(GPU, "h1")
        assert pcie.bind("pcie/gpu-a1", "h2", ctx) == Binding("pcie/gpu-a1", "h2")
        assert list(pcie.bindings()) == [Binding(GPU, "h1"), Binding("pcie/gpu-a1", "h2")]

    def test_bind_is_idempotent(self, pcie: SimFabric, ctx: CallContext) -> None:
        first = pcie.bind(GPU, "h1", ctx)
        assert pcie.bind(GPU, "h1", ctx) == first
        assert list(pcie.bindings()) == [first]

    def test_a_repeat_succeeds_even_after_the_device_failed(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.bind(GPU, "h1", ctx)
        pcie.fail_device(GPU)
        assert pcie.bind(GPU, "h1", ctx) == Binding(GPU, "h1")

    def test_a_failed_device_stays_bound(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.bind(GPU, "h1", ctx)
        pcie.fail_device(GPU)
        assert list(pcie.bindings()) == [Binding(GPU, "h1")]


class TestBindErrors:
    """Each refusal raises its own error type and binds nothing."""

    def test_bound_to_another_host(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.bind(GPU, "h1", ctx)
        with pytest.raises(DeviceBusyError, match="pcie/gpu-a0 is bound to host h1"):
            pcie.bind(GPU, "h2", ctx)
        assert list(pcie.bindings()) == [Binding(GPU, "h1")]

    def test_failed_device(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.fail_device(GPU, "uncorrectable ECC")
        with pytest.raises(DeviceBusyError, match=r"FAILED \(uncorrectable ECC\)"):
            pcie.bind(GPU, "h1", ctx)
        assert pcie.bindings() == ()
        pcie.repair_device(GPU)
        assert pcie.bind(GPU, "h1", ctx) == Binding(GPU, "h1")

    def test_unknown_device(self, pcie: SimFabric, ctx: CallContext) -> None:
        with pytest.raises(UnknownDeviceError) as info:
            pcie.bind("pcie/gpu-z9", "h1", ctx)
        assert info.value.name == "pcie/gpu-z9"

    def test_local_id_gets_a_hint(self, pcie: SimFabric, ctx: CallContext) -> None:
        with pytest.raises(UnknownDeviceError, match="device ids carry the fabric name: pcie/gpu-a0"):
            pcie.bind("gpu-a0", "h1", ctx)

    def test_unknown_host(self, pcie: SimFabric, ctx: CallContext) -> None:
        with pytest.raises(UnknownHostError, match="host 'h9' is not attached to fabric 'pcie'"):
            pcie.bind(GPU, "h9", ctx)
        assert pcie.bindings() == ()

    def test_unreachable_over_a_down_link(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.set_link("pcie/top-a", "pcie/chassis-a", False)
        with pytest.raises(HostUnreachableError, match="host h1 cannot reach device pcie/gpu-a0"):
            pcie.bind(GPU, "h1", ctx)
        assert pcie.bind("pcie/gpu-b0", "h1", ctx).host == "h1"
        pcie.set_link("pcie/top-a", "pcie/chassis-a", True)
        assert pcie.bind(GPU, "h1", ctx).host == "h1"

    def test_a_link_going_down_cuts_off_every_host_of_the_switch(self, pcie: SimFabric, ctx: CallContext) -> None:
        """Reachability is remembered per switch, so a link that fails after binds were answered must still
        cut off a host that shares the switch with one already served."""
        assert pcie.bind(GPU, "h1", ctx).host == "h1"
        pcie.set_link("pcie/top-a", "pcie/chassis-a", False)
        with pytest.raises(HostUnreachableError, match="host h2 cannot reach device pcie/gpu-a1"):
            pcie.bind("pcie/gpu-a1", "h2", ctx)
        assert pcie.bindings() == (Binding(GPU, "h1"),)

    def test_unreachable_when_the_host_link_is_down(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.set_link("h2", "top-a", False)
        with pytest.raises(HostUnreachableError):
            pcie.bind(GPU, "h2", ctx)
        assert pcie.bind(GPU, "h1", ctx).host == "h1"

    def test_a_pool_device_is_carved_not_bound(self, cxl: SimFabric, ctx: CallContext) -> None:
        with pytest.raises(DeviceBusyError, match="backs pool cxl/mem0"):
            cxl.bind("cxl/cxlmem0", "h1", ctx)

    def test_flaky_bind_fails_the_next_binds(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.flaky_bind(GPU, 2)
        for _ in range(2):
            with pytest.raises(FabricUnavailableError) as info:
                pcie.bind(GPU, "h1", ctx)
            assert info.value.retryable
            assert pcie.bindings() == ()
        assert pcie.bind(GPU, "h1", ctx) == Binding(GPU, "h1")

    def test_flaky_bind_of_one_device_spares_the_others(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.flaky_bind(GPU, 1)
        assert pcie.bind("pcie/gpu-a1", "h1", ctx).host == "h1"
        with pytest.raises(FabricUnavailableError):
            pcie.bind(GPU, "h1", ctx)

    def test_flaky_bind_of_any_device(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.flaky_bind(None, 2)
        with pytest.raises(FabricUnavailableError):
            pcie.bind(GPU, "h1", ctx)
        with pytest.raises(FabricUnavailableError):
            pcie.bind("pcie/gpu-a1", "h1", ctx)
        assert pcie.bind("pcie/gpu-a2", "h1", ctx).host == "h1"

    def test_flaky_bind_zero_clears(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.flaky_bind(GPU, 5)
        pcie.flaky_bind(GPU, 0)
        assert pcie.bind(GPU, "h1", ctx).host == "h1"

    def test_no_fault_left_pending_once_used_up_or_cleared(self, pcie: SimFabric, ctx: CallContext) -> None:
        """A bind makes no call to take a fault unless one is pending for its device or for any device: a fault
        used up or cleared leaves no count behind, not even a zero, for a bind to take as pending."""
        pcie.flaky_bind(GPU, 1)
        pcie.flaky_bind("pcie/gpu-a1", 3)
        pcie.flaky_bind("pcie/gpu-a1", 0)
        pcie.flaky_bind(None, 1)
        for _ in range(2):
            with pytest.raises(FabricUnavailableError):
                pcie.bind(GPU, "h1", ctx)
        assert (pcie._flaky, pcie._flaky_any) == ({}, 0)
        assert pcie.bind(GPU, "h1", ctx).host == "h1"

    def test_flaky_bind_checks_its_arguments(self, pcie: SimFabric) -> None:
        with pytest.raises(UnknownDeviceError):
            pcie.flaky_bind("pcie/nope", 1)
        with pytest.raises(InvalidRequestError):
            pcie.flaky_bind(GPU, -1)

    @pytest.mark.parametrize("device", [GPU, None])
    def test_flaky_bind_takes_at_most_what_the_wire_carries(self, pcie: SimFabric, device: str | None) -> None:
        """In process it took any count, where over the wire more than 1,000,000 is refused: a test that passed
        against the sim failed against the same sim out of process."""
        with pytest.raises(InvalidRequestError, match=r"^failures: at most 1000000$") as info:
            pcie.flaky_bind(device, 1_000_001)
        assert info.value.field == "failures"
        pcie.flaky_bind(device, 1_000_000)


class TestUnbind:
    """unbind removes a binding; an absent binding is already unbound and not an error."""

    def test_unbind(self, pcie: SimFabric, ctx: CallContext) -> None:
        binding = pcie.bind(GPU, "h1", ctx)
        pcie.unbind(binding, ctx)
        assert pcie.bindings() == ()
        assert pcie.bind(GPU, "h2", ctx).host == "h2"

    def test_unbind_is_idempotent(self, pcie: SimFabric, ctx: CallContext) -> None:
        binding = pcie.bind(GPU, "h1", ctx)
        pcie.unbind(binding, ctx)
        pcie.unbind(binding, ctx)
        assert pcie.bindings() == ()

    def test_unbind_from_the_wrong_host_leaves_the_device_bound(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.bind(GPU, "h1", ctx)
        pcie.unbind(Binding(GPU, "h2"), ctx)
        assert list(pcie.bindings()) == [Binding(GPU, "h1")]

    def test_unbind_of_unknown_names_is_a_no_op(self, pcie: SimFabric, ctx: CallContext) -> None:
        pcie.unbind(Binding("pcie/ghost", "h1"), ctx)
        pcie.unbind(Binding(GPU, "h99"), ctx)
        assert pcie.bindings() == ()

    def test_unbind_works_over_a_down_link(self, pcie: SimFabric, ctx: CallContext) -> None:
        binding = pcie.bind(GPU, "h1", ctx)
        pcie.set_link("h1", "pcie/top-a", False)
        pcie.unbind(binding, ctx)
        assert pcie.bindings() == ()


class TestFencing:
    """The highest epoch seen wins; an older one is refused before anything changes."""

    def test_stale_epoch_refused_for_every_mutation(self, pcie: SimFabric, cxl: SimFabric) -> None:
        new, old = CallContext(epoch=5), CallContext(epoch=4)
        binding = pcie.bind(GPU, "h1", new)
        with pytest.raises(StaleEpochError, match="epoch 4 is older than 5"):
            pcie.bind("pcie/gpu-a1", "h1", old)
        with pytest.raises(StaleEpochError):
            pcie.bind(GPU, "h1", old)  # even a repeat
        with pytest.raises(StaleEpochError):
            pcie.unbind(binding, old)
        with pytest.raises(StaleEpochError):
            pcie.device("pcie/gpu-a5").sanitize(old)
        assert list(pcie.bindings()) == [binding]
        assert pcie.sanitized("pcie/gpu-a5") == 0

        pool = cxl.pool("cxl/mem0")
        allocation = pool.allocate("a1", "h1", 1 << 30, new)
        with pytest.raises(StaleEpochError):
            pool.allocate("a2", "h1", 1 << 30, old)
        with pytest.raises(StaleEpochError):
            pool.release("a1", old)
        assert list(pool.allocations()) == [allocation]

    def test_a_call_in_flight_when_a_newer_epoch_arrives_changes_nothing(self) -> None:
        """A bind that validated under epoch 5 and is still working when epoch 6 fences the fabric does not
        commit: the manager of epoch 6 may have read the bindings already."""
        slow = SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=0.5)
        failed: list[BaseException] = []

        def old_bind() -> None:
            try:
                slow.bind(GPU, "h1", CallContext(epoch=5))
            except BaseException as exc:
                failed.append(exc)

        slow.bind("pcie/gpu-a1", "h1", CallContext(epoch=5))
        worker = threading.Thread(target=old_bind)
        worker.start()
        in_its_delay(slow, worker)
        slow.bind("pcie/gpu-a2", "h2", CallContext(epoch=6))
        worker.join(5.0)
        assert len(failed) == 1 and isinstance(failed[0], StaleEpochError)
        assert "fenced off by 6 while the call ran" in str(failed[0])
        assert GPU not in {b.device for b in slow.bindings()}

    def test_a_newer_epoch_is_remembered_from_a_call_that_fails(self, pcie: SimFabric) -> None:
        with pytest.raises(DeadlineExceededError):
            pcie.bind(GPU, "h1", CallContext(epoch=100, deadline=time.monotonic() - 1))
        assert pcie.epoch == 100
        with pytest.raises(StaleEpochError):
            pcie.bind(GPU, "h1", CallContext(epoch=99))

    def test_a_newer_epoch_is_remembered(self, pcie: SimFabric) -> None:
        pcie.bind(GPU, "h1", CallContext(epoch=2))
        assert pcie.epoch == 2
        pcie.bind("pcie/gpu-a1", "h1", CallContext(epoch=3))
        assert pcie.epoch == 3
        with pytest.raises(StaleEpochError):
            pcie.bind("pcie/gpu-a2", "h1", CallContext(epoch=2))
        assert pcie.bind("pcie/gpu-a2", "h1", CallContext(epoch=3)).host == "h1"

    def test_a_failing_call_still_fences(self, pcie: SimFabric) -> None:
        with pytest.raises(UnknownHostError):
            pcie.bind(GPU, "nobody", CallContext(epoch=9))
        assert pcie.epoch == 9
        with pytest.raises(StaleEpochError):
            pcie.bind(GPU, "h1", CallContext(epoch=8))

    def test_stale_check_comes_before_validation(self, pcie: SimFabric) -> None:
        pcie.bind(GPU, "h1", CallContext(epoch=3))
        with pytest.raises(StaleEpochError):
            pcie.bind("pcie/ghost", "nobody", CallContext(epoch=1))


def _mutating_calls(cxl: SimFabric) -> list[Callable[[CallContext], object]]:
    """Every call of ``cxl`` that carries an epoch, each on the fabric's one CXL device and pool."""
    pool = cxl.pool("cxl/mem0")
    return [
        lambda ctx: cxl.bind("cxl/cxlmem0", "h1", ctx),
        lambda ctx: cxl.unbind(Binding("cxl/cxlmem0", "h1"), ctx),
        lambda ctx: pool.allocate("a", "h1", 1 << 30, ctx),
        lambda ctx: pool.release("a", ctx),
        lambda ctx: cxl.device("cxl/cxlmem0").sanitize(ctx),
    ]


class TestMalformedEpoch:
    """An epoch that is not an integer is refused with InvalidRequestError, as the driver protocol refuses it,
    and never remembered: compared, one that is not a number raised a TypeError, which no driver may raise, and
    a float or a bool was saved to the state file, which then no longer loaded."""

    @pytest.mark.parametrize("bad", ["3", 2.5, True, None], ids=["text", "float", "bool", "none"])
    def test_every_mutating_call(self, cxl: SimFabric, bad: Any) -> None:
        pool = cxl.pool("cxl/mem0")
        for call in _mutating_calls(cxl):
            with pytest.raises(InvalidRequestError, match="epoch: give an integer") as info:
                call(CallContext(epoch=bad))
            assert info.value.field == "epoch"
        assert cxl.epoch == 0 and cxl.bindings() == () and pool.allocations() == ()

    def test_an_epoch_the_wire_cannot_carry(self, cxl: SimFabric) -> None:
        """The wire carries a uint64 epoch, and the remote path refuses one above 2**64 - 1 with this error: in
        process it was accepted and remembered, fencing off every epoch a manager can send over the wire."""
        pool = cxl.pool("cxl/mem0")
        for call in _mutating_calls(cxl):
            with pytest.raises(InvalidRequestError) as info:
                call(CallContext(epoch=2**64))
            assert info.value.message == f"epoch: at most {2**64 - 1}, not {2**64}"
            assert info.value.field == "epoch"
        assert cxl.epoch == 0 and cxl.bindings() == () and pool.allocations() == ()
        pool.allocate("a", "h1", 1 << 30, CallContext(epoch=2**64 - 1))
        assert cxl.epoch == 2**64 - 1

    def test_the_state_file_still_loads(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        fabric = SimFabric(load_topology("pcie", "demo-pcie"), state_file=path)
        fabric.bind(GPU, "h1", CallContext(epoch=2))
        with pytest.raises(InvalidRequestError):
            fabric.bind("pcie/gpu-a1", "h1", CallContext(epoch=2.5))  # type: ignore[arg-type]
        assert SimFabric(load_topology("pcie", "demo-pcie"), state_file=path).epoch == 2


BAD_IDS = [pytest.param(7, id="int"), pytest.param(b"x", id="bytes"), pytest.param("", id="empty")]
BAD_IDS += [pytest.param(["x"], id="list"), pytest.param(None, id="none")]


class TestMalformedIds:
    """An id that is not a non-empty string is refused with InvalidRequestError by every call, after the fence,
    so that nothing the state file cannot hold is ever used."""

    @pytest.mark.parametrize("bad", BAD_IDS)
    def test_mutating_calls(self, bad: Any) -> None:
        self._refused_by_every_mutating_call(bad, "must be a non-empty string")

    @pytest.mark.parametrize("bad", ["a b", "a\tb", "gpu\n", "x" * 257])
    def test_text_the_driver_protocol_carries_as_no_id(self, bad: str) -> None:
        """The sim carved under "a b" and took an unbind of "cxl0/no such" as a no-op, while the same sim served
        over the wire refused both: one rule (`disagg.interfaces.check_id`) now says what an id is."""
        self._refused_by_every_mutating_call(bad, "printable characters without spaces")

    @staticmethod
    def _refused_by_every_mutating_call(bad: Any, says: str) -> None:
        cxl = SimFabric(load_topology("cxl", "demo-cxl"))
        pool = cxl.pool("cxl/mem0")
        calls: list[Callable[[CallContext], object]] = [
            lambda ctx: pool.allocate(bad, "h1", 1 << 30, ctx),
            lambda ctx: pool.allocate("a", bad, 1 << 30, ctx),
            lambda ctx: pool.release(bad, ctx),
            lambda ctx: cxl.bind(bad, "h1", ctx),
            lambda ctx: cxl.bind("cxl/mem0", bad, ctx),
            lambda ctx: cxl.unbind(Binding(bad, "h1"), ctx),
            lambda ctx: cxl.unbind(Binding("cxl/mem0", bad), ctx),
        ]
        for epoch, call in enumerate(calls, start=1):
            with pytest.raises(InvalidRequestError, match=says):
                call(CallContext(epoch=epoch))
            assert cxl.epoch == epoch  # the fence came first
        assert pool.allocations() == () and cxl.bindings() == ()

    @pytest.mark.parametrize("bad", BAD_IDS)
    def test_other_calls(self, bad: Any) -> None:
        pcie = SimFabric(load_topology("pcie", "demo-pcie"))
        calls: list[Callable[[], object]] = [
            lambda: pcie.device(bad),
            lambda: pcie.pool(bad),
            lambda: pcie.fail_device(bad),
            lambda: pcie.repair_device(bad),
            lambda: pcie.set_link(bad, "top-a", False),
        ]
        if bad is not None:  # flaky_bind(None, n) means any device
            calls.append(lambda: pcie.flaky_bind(bad, 1))
        for call in calls:
            with pytest.raises(InvalidRequestError, match="must be a non-empty string"):
                call()


class TestDeviceHandle:
    """device() gives a live handle: current description, health, and an instant, recorded sanitize."""

    def test_describe_and_health(self, pcie: SimFabric) -> None:
        handle = pcie.device(GPU)
        assert isinstance(handle, DeviceHandle)
        assert handle.id == GPU
        assert handle.describe().model == "H200"
        assert handle.health() is Health.OK
        pcie.fail_device(GPU)
        assert handle.health() is Health.FAILED

    def test_unknown_device(self, pcie: SimFabric) -> None:
        with pytest.raises(UnknownDeviceError):
            pcie.device("pcie/ghost")

    def test_sanitize_is_recorded(self, pcie: SimFabric, ctx: CallContext) -> None:
        handle = pcie.device(GPU)
        handle.sanitize(ctx)
        handle.sanitize(ctx)
        assert pcie.sanitized(GPU) == 2
        assert pcie.sanitized("pcie/gpu-a1") == 0

    def test_sanitize_refused_while_bound(self, pcie: SimFabric, ctx: CallContext) -> None:
        binding = pcie.bind(GPU, "h1", ctx)
        with pytest.raises(DeviceBusyError, match="unbind it before sanitizing"):
            pcie.device(GPU).sanitize(ctx)
        pcie.unbind(binding, ctx)
        pcie.device(GPU).sanitize(ctx)
        assert pcie.sanitized(GPU) == 1

    def test_sanitize_refused_while_memory_is_carved(self, cxl: SimFabric, ctx: CallContext) -> None:
        cxl.pool("cxl/mem0").allocate("a", "h1", 1 << 30, ctx)
        with pytest.raises(DeviceBusyError, match="carved"):
            cxl.device("cxl/cxlmem0").sanitize(ctx)
        cxl.device("cxl/cxlmem1").sanitize(ctx)
        assert cxl.sanitized("cxl/cxlmem1") == 1
