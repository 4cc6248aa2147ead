"""RemoteFabric: the Fabric interface over FabricDriverService, with the SDK's own errors, deadlines and epochs."""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from composer_helpers import ForwardingPool
from disagg.composer import FabricComposer
from disagg.composer.execution import ExecutionFailedError, Executor, in_doubt
from disagg.errors import (
    OUTCOME,
    OUTCOME_UNKNOWN,
    CapacityExhaustedError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    DeviceBusyError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    HostUnreachableError,
    InvalidRequestError,
    LeadershipLostError,
    NoFitError,
    NotFoundError,
    OverloadedError,
    RequestIdReusedError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
    UnsupportedError,
)
from disagg.interfaces import CallContext, Pool
from disagg.interfaces.fabric import MAX_ID
from disagg.model import Allocation, Binding, DeviceKind, DevicePick, Extent, Health, Link, Topology
from disagg.remote import DriverServer, RemoteFabric
from disagg.remote.fabric import connected
from disagg.remote.plugin import create_fabric
from disagg.remote.service import FabricDriverServicer
from disagg.requestlang import parse_request
from disagg.wire import driver as wire
from disagg_sim import SIM_CAPABILITIES, SimFabric
from disagg_sim import create_fabric as create_sim
from google.rpc import code_pb2, status_pb2
from remote_helpers import Plain, Secretive, YesDriver, cxl, eventually, pcie, served, serving_bare
from server_helpers import serving, socket_path


@attrs.frozen
class _Status(grpc.Status):  # type: ignore[misc]
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, bytes], ...]


class BindsThenFails(Plain):
    """A driver with a bug: its bind binds, then raises an exception that is not an SDK error."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.inner.bind(device, host, ctx)
        raise RuntimeError("a bug after the hardware bound")


class _Unprintable:
    """A vendor's handle whose repr asks the hardware, which has just failed."""

    def __repr__(self) -> str:
        raise OSError("the handle is closed: /dev/bmc-secret")


class BindsThenFailsUnprintably(Plain):
    """A driver with a bug: its bind binds, then raises an exception whose repr fails."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.inner.bind(device, host, ctx)
        raise RuntimeError(_Unprintable())


class HeldBind(Plain):
    """Hardware that cannot be interrupted: a bind checks its deadline, then works ``hold_s`` and binds whatever
    the deadline says by then. ``started`` and ``finished`` are set as a bind begins and ends."""

    def __init__(self, inner: SimFabric, hold_s: float) -> None:
        super().__init__(inner)
        self.hold_s = hold_s
        self.started = threading.Event()
        self.finished = threading.Event()

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        try:
            ctx.check_deadline()
            self.started.set()
            time.sleep(self.hold_s)
            return self.inner.bind(device, host, CallContext(epoch=ctx.epoch, request_id=ctx.request_id))
        finally:
            self.finished.set()


class HeldPool(ForwardingPool):
    """A pool whose allocate, like `HeldBind`'s bind, works ``hold_s`` past its deadline check."""

    def __init__(self, inner: Pool, hold_s: float, finished: threading.Event) -> None:
        super().__init__(inner)
        self.hold_s, self.finished = hold_s, finished

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        try:
            ctx.check_deadline()
            time.sleep(self.hold_s)
            return self.inner.allocate(allocation_id, host, amount_bytes, CallContext(epoch=ctx.epoch))
        finally:
            self.finished.set()


class HeldAllocate(Plain):
    """A fabric whose pools are `HeldPool`s."""

    def __init__(self, inner: SimFabric, hold_s: float) -> None:
        super().__init__(inner)
        self.hold_s = hold_s
        self.finished = threading.Event()

    def pool(self, pool: str) -> Pool:
        return HeldPool(self.inner.pool(pool), self.hold_s, self.finished)


class AnswersAnotherBinding(Plain):
    """A driver with a bug: its bind binds, then answers a binding of another host (or, sent as an empty
    message, none at all)."""

    def __init__(self, inner: SimFabric, answer: Binding) -> None:
        super().__init__(inner)
        self.answer = answer

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.inner.bind(device, host, ctx)
        return self.answer


class AnswersAnotherAllocationPool(HeldPool):
    """A pool that carves, then answers ``answer`` instead of what it carved."""

    def __init__(self, inner: Pool, answer: Allocation) -> None:
        super().__init__(inner, 0.0, threading.Event())
        self.answer = answer

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        super().allocate(allocation_id, host, amount_bytes, ctx)
        return self.answer


class AnswersAnotherAllocation(Plain):
    """A driver with a bug: its pools answer an allocation that is not the one asked for."""

    def __init__(self, inner: SimFabric, answer: Allocation) -> None:
        super().__init__(inner)
        self.answer = answer

    def pool(self, pool: str) -> Pool:
        return AnswersAnotherAllocationPool(self.inner.pool(pool), self.answer)


GPU = "pcie0/gpu-a0"
LINKS = len(pcie().discover().links)
"""How many links the demo PCIe fabric has."""
CTX = CallContext(epoch=1)


@pytest.fixture
def sim() -> SimFabric:
    return pcie()


@pytest.fixture(params=["unix", "tcp"])
def remote(request: pytest.FixtureRequest, sim: SimFabric) -> Iterator[RemoteFabric]:
    with served(sim, request.param) as server:
        fabric = RemoteFabric("pcie0", server.address, connect_timeout_s=5)
        try:
            yield fabric
        finally:
            fabric.close()


class TestConnect:
    """Construction reads the served fabric's name and capabilities, and refuses a mismatch or no answer."""

    def test_capabilities_are_the_remote_drivers(self, remote: RemoteFabric) -> None:
        assert remote.name == "pcie0" and remote.driver == "sim"
        assert remote.capabilities() == SIM_CAPABILITIES

    def test_a_fabric_managers_address_is_a_configuration_error(self, tmp_path: Path) -> None:
        """It answered UNIMPLEMENTED ("Method not found!"), raised as an unsupported capability."""
        with (
            serving(socket_path(tmp_path)) as fm,
            pytest.raises(ConfigError, match=r"does not serve disagg\.driver\.v1\.FabricDriverService"),
        ):
            create_fabric("pcie0", {"address": fm.address, "connect_timeout_s": 2})

    def test_name_mismatch_names_both(self, sim: SimFabric) -> None:
        with served(sim) as server, pytest.raises(ConfigError) as info:
            RemoteFabric("gpus", server.address, connect_timeout_s=5)
        assert "'gpus'" in info.value.message and "'pcie0'" in info.value.message
        assert server.address in info.value.message

    @pytest.mark.parametrize("address", ["unix:/nonexistent/disagg/driver.sock", "127.0.0.1:9"])
    def test_unreachable_names_the_address_within_the_connect_timeout(self, address: str) -> None:
        started = time.monotonic()
        with pytest.raises(FabricUnavailableError) as info:
            RemoteFabric("pcie0", address, connect_timeout_s=0.3)
        assert time.monotonic() - started < 2.0
        assert address in info.value.message and "0.3s" in info.value.message

    @pytest.mark.parametrize("address", ["unix:/nonexistent/disagg/driver.sock", "127.0.0.1:9"])
    @pytest.mark.parametrize("option", ["connect_timeout_s", "call_timeout_s"])
    @pytest.mark.parametrize("seconds", [math.inf, 1e300, 1e10, 86_400.5, 0.0, math.nan])
    def test_a_timeout_grpc_cannot_wait_is_refused(self, address: str, option: str, seconds: float) -> None:
        """No timeout, as infinity or a huge number: grpcio failed the first call at once, and the refused
        address was said to have had no driver answer "within 1e+300s"."""
        with pytest.raises(ConfigError) as info:
            RemoteFabric("pcie0", address, **{"connect_timeout_s": 0.3, "call_timeout_s": 0.3, option: seconds})
        assert info.value.field == option
        assert "at most 86400 (a day)" in info.value.message and "fabric 'pcie0'" in info.value.message

    @pytest.mark.parametrize("address", ["unix:/nonexistent/disagg/driver.sock", "127.0.0.1:9"])
    def test_from_the_configuration_it_is_unreachable_until_it_answers(self, address: str) -> None:
        """The `remote` driver of a configuration: one driver down at start-up stopped the whole fabric manager
        (and with high availability every replica, in a loop); now its fabric is unreachable meanwhile."""
        fabric = create_fabric("pcie0", {"address": address, "connect_timeout_s": 0.3})
        try:
            for call in (fabric.capabilities, fabric.discover):
                with pytest.raises(FabricUnavailableError) as info:
                    call()
                assert address in info.value.message and "0.3s" in info.value.message
        finally:
            fabric.close()

    def test_a_call_without_an_answer_has_an_unknown_outcome(self, sim: SimFabric) -> None:
        """The driver's process went away while the bind ran: the bind may or may not have happened (here it
        did), and the error says so; an error the driver answered with does not."""
        gpu = next(d.id for d in sim.discover().devices if d.kind is DeviceKind.GPU)
        driver = HeldBind(sim, 0.5)
        with served(driver) as server:
            remote = RemoteFabric("pcie0", server.address, connect_timeout_s=5)
            with pytest.raises(UnknownDeviceError) as answered:
                remote.bind("pcie0/no-such-gpu", "h1", CallContext(epoch=1))
            assert OUTCOME not in answered.value.metadata
            driver.started.clear()
            driver.finished.clear()
            stopping = threading.Thread(target=lambda: driver.started.wait(5) and server.stop(grace=0))
            stopping.start()
            try:
                with pytest.raises(FabricUnavailableError) as lost:
                    remote.bind(gpu, "h1", CallContext.with_timeout(5.0, epoch=1))
                assert lost.value.metadata[OUTCOME] == OUTCOME_UNKNOWN
            finally:
                stopping.join()
                remote.close()
        assert driver.finished.wait(5) and sim.bindings() == (Binding(gpu, "h1"),)

    def test_an_endpoint_that_is_down_changed_nothing(self, sim: SimFabric) -> None:
        """No connection, so the call was never sent (gRPC fails it at once): an answer, nothing changed. It was
        taken for a call that may have happened, and a compose left a FAILED composition with the device
        named as left over, though it was never touched."""
        with served(sim) as server:
            remote = RemoteFabric("pcie0", server.address, connect_timeout_s=5)
        try:
            with pytest.raises(FabricUnavailableError) as refused:
                remote.bind(GPU, "h1", CallContext.with_timeout(5.0, epoch=1))
            assert OUTCOME not in refused.value.metadata and not in_doubt(refused.value)
            executor = Executor({"pcie0": remote}, lambda deadline: CallContext(epoch=1, deadline=deadline))
            with pytest.raises(ExecutionFailedError) as failed:
                executor.apply("h1", [("pcie0", DevicePick(GPU, 0, 0))], [], deadline=time.monotonic() + 5)
            assert failed.value.leftovers == ()
        finally:
            remote.close()

    def test_a_call_the_endpoint_never_took_changed_nothing(
        self, sim: SimFabric, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The endpoint went away after the remote fabric last saw it connected, before the call (no check of
        the endpoint in between): gRPC could not connect and never sent it."""
        with served(sim) as server:
            remote = RemoteFabric("pcie0", server.address, connect_timeout_s=5)
        monkeypatch.setattr(remote, "_served_here", lambda timeout: SIM_CAPABILITIES, raising=False)
        try:
            with pytest.raises(FabricUnavailableError, match="failed to connect to all addresses") as refused:
                remote.unbind(Binding(GPU, "h1"), CallContext.with_timeout(5.0, epoch=1))
            assert OUTCOME not in refused.value.metadata and server.address in refused.value.message
        finally:
            remote.close()

    def test_close_is_idempotent_and_final(self, remote: RemoteFabric) -> None:
        remote.subscribe(lambda event: None)
        remote.close()
        remote.close()
        with pytest.raises(FabricUnavailableError, match="closed"):
            remote.bindings()
        with pytest.raises(FabricUnavailableError, match="closed"):
            remote.subscribe(lambda event: None)


class TestCalls:
    """Each method is one RPC that answers as the in-process fabric does."""

    def test_bind_bindings_unbind(self, remote: RemoteFabric, sim: SimFabric) -> None:
        assert remote.bind(GPU, "h1", CTX) == Binding(GPU, "h1")
        assert remote.bind(GPU, "h1", CTX) == Binding(GPU, "h1")
        assert list(remote.bindings()) == list(sim.bindings()) == [Binding(GPU, "h1")]
        remote.unbind(Binding(GPU, "h1"), CTX)
        remote.unbind(Binding(GPU, "h1"), CTX)
        remote.unbind(Binding("pcie0/unknown", "h9"), CTX)
        assert list(remote.bindings()) == []

    def test_discover_matches(self, remote: RemoteFabric, sim: SimFabric) -> None:
        assert remote.discover() == sim.discover()

    def test_pools(self) -> None:
        with served(cxl()) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                pool = remote.pool("cxl0/mem0")
                assert pool.info() == remote.discover().pools[0]
                allocation = pool.allocate("a1", "h1", 1 << 30, CTX)
                assert pool.allocate("a1", "h1", 1 << 30, CTX) == allocation
                assert list(pool.allocations()) == [allocation]
                assert pool.free_bytes() == (2 << 40) - (1 << 30)
                with pytest.raises(ConflictError):
                    pool.allocate("a1", "h2", 1 << 30, CTX)
                with pytest.raises(CapacityExhaustedError):
                    pool.allocate("a2", "h1", 3 << 40, CTX)
                pool.release("a1", CTX)
                pool.release("a1", CTX)
                assert list(pool.allocations()) == []
                missing = remote.pool("cxl0/mem9")  # not listed: the driver judges each call on it
                with pytest.raises(NotFoundError, match="pools: cxl0/mem0, cxl0/mem1") as refused:
                    missing.release("a1", CTX)
                assert refused.value.resource_type == "pool"
                with pytest.raises(NotFoundError, match="lists no pool 'cxl0/mem9'"):
                    missing.info()
            finally:
                remote.close()

    def test_device_handle(self, remote: RemoteFabric, sim: SimFabric) -> None:
        device = remote.device(GPU)
        assert device.describe() == sim.device(GPU).describe()
        assert device.health() is Health.OK
        device.sanitize(CTX)
        assert sim.sanitized(GPU) == 1
        remote.bind(GPU, "h1", CTX)
        with pytest.raises(DeviceBusyError):
            device.sanitize(CTX)
        with pytest.raises(UnknownDeviceError):
            remote.device("pcie0/gpu-z9")

    def test_epoch_request_id_and_deadline_reach_the_driver(self) -> None:
        plain = Plain(pcie())
        with served(plain) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                remote.bind(GPU, "h1", CallContext.with_timeout(7.0, epoch=42, request_id="req-1"))
                remote.unbind(Binding(GPU, "h1"), CallContext(epoch=43))
            finally:
                remote.close()
        (_, bind), (_, unbind) = plain.contexts
        assert (bind.epoch, bind.request_id, unbind.epoch) == (42, "req-1", 43)
        assert bind.deadline is not None and 6.0 < bind.deadline - time.monotonic() < 7.1
        assert unbind.deadline is not None and unbind.deadline - time.monotonic() > 25  # the default call timeout


class TestErrors:
    """A failed call raises the same SDK error type as in process, so the composer cannot tell the difference."""

    @pytest.mark.parametrize(
        ("error", "call"),
        [
            (CapacityExhaustedError, lambda f: f.pool("cxl0/mem0").allocate("a1", "h1", 2**64, CallContext())),
            (StaleEpochError, lambda f: f.pool("cxl0/mem0").release("a1", CallContext(epoch=-1))),
            (StaleEpochError, lambda f: f.bind("cxl0/cxlmem0", "h1", CallContext(epoch=-1))),
            (InvalidRequestError, lambda f: f.pool("cxl0/mem0").release("a1", CallContext(epoch=2**64))),
            (InvalidRequestError, lambda f: f.flaky_bind(None, 2**32)),
        ],
        ids=["allocate-2**64-bytes", "release-epoch-minus-1", "bind-epoch-minus-1", "epoch-2**64", "flaky-2**32"],
    )
    def test_values_the_wire_cannot_carry_are_sdk_errors(
        self, error: type[Exception], call: Callable[[RemoteFabric], object]
    ) -> None:
        """protobuf refused them with a bare ValueError, which the composer does not expect of a driver."""
        with served(cxl()) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                with pytest.raises(error):
                    call(remote)
            finally:
                remote.close()

    @pytest.mark.parametrize(
        ("field", "call"),
        [
            ("host", lambda f: f.bind(GPU, 7, CTX)),
            ("device", lambda f: f.bind(None, "h1", CTX)),
            ("device", lambda f: f.bind("pcie0/\udc80", "h1", CTX)),
            ("binding.device", lambda f: f.unbind(Binding(None, "h1"), CTX)),  # type: ignore[arg-type]
            ("binding.host", lambda f: f.unbind(Binding(GPU, "\udc80"), CTX)),
            ("binding", lambda f: f.unbind((GPU, "h1"), CTX)),
            ("epoch", lambda f: f.bind(GPU, "h1", CallContext(epoch=1.5))),  # type: ignore[arg-type]
            ("request_id", lambda f: f.bind(GPU, "h1", CallContext(epoch=1, request_id=None))),  # type: ignore[arg-type]
            ("deadline", lambda f: f.bind(GPU, "h1", CallContext(epoch=1, deadline="soon"))),  # type: ignore[arg-type]
            ("target", lambda f: f.fail_device(None)),
            ("message", lambda f: f.fail_device(GPU, b"ECC")),
            ("device", lambda f: f.flaky_bind("", 2)),
        ],
        ids=[
            "host-int",
            "device-none",
            "device-surrogate",
            "unbind-device-none",
            "unbind-host-surrogate",
            "unbind-a-tuple",
            "epoch-float",
            "request-id-none",
            "deadline-str",
            "fault-target-none",
            "fault-message-bytes",
            "flaky-bind-empty-device",
        ],
    )
    def test_bad_arguments_are_invalid_requests_naming_the_field(
        self, remote: RemoteFabric, sim: SimFabric, field: str, call: Callable[[RemoteFabric], object]
    ) -> None:
        """As the in-process sim answers them, instead of protobuf's TypeError or UnicodeEncodeError; an empty
        device to flaky_bind armed a failure of any device (the wire's "")."""
        with pytest.raises(InvalidRequestError) as info:
            call(remote)
        assert info.value.field == field
        assert remote.bind("pcie0/gpu-a3", "h1", CTX) == Binding("pcie0/gpu-a3", "h1")  # nothing was armed
        assert sim.bindings() == (Binding("pcie0/gpu-a3", "h1"),)

    @pytest.mark.parametrize("away", [1e10, 1e19, math.inf, math.nan], ids=["1e10s", "1e19s", "inf", "nan"])
    def test_a_deadline_that_never_comes_is_none(self, remote: RemoteFabric, away: float) -> None:
        """grpcio failed every call at once with DeadlineExceededError; in process the call succeeds."""
        assert remote.bind(GPU, "h1", CallContext(epoch=1, deadline=time.monotonic() + away)) == Binding(GPU, "h1")
        remote.unbind(Binding(GPU, "h1"), CallContext(epoch=1, deadline=time.monotonic() + away))
        assert remote.bindings() == ()

    def test_a_long_request_id_is_cut_to_fit_recognisably(self) -> None:
        """The composer's Python API passes any request id through, and an in-process driver takes it: every
        remote bind with one over 128 characters failed with InvalidRequestError."""
        long_id = "compose-" + "x" * 300
        plain = Plain(pcie())
        with served(plain) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                remote.bind(GPU, "h1", CallContext(request_id=long_id))
            finally:
                remote.close()
        sent = plain.contexts[0][1].request_id
        assert (
            len(sent) <= wire.MAX_REQUEST_ID
            and sent.startswith("compose-xxx")
            and sent == (wire.request_id_to_wire(long_id))
        )

    def test_driver_errors(self, remote: RemoteFabric) -> None:
        remote.bind(GPU, "h1", CallContext(epoch=5))
        cases = [
            (DeviceBusyError, lambda: remote.bind(GPU, "h2", CallContext(epoch=5))),
            (StaleEpochError, lambda: remote.bind("pcie0/gpu-a1", "h1", CallContext(epoch=4))),
            (UnknownDeviceError, lambda: remote.bind("pcie0/nope", "h1", CallContext(epoch=5))),
            (UnknownHostError, lambda: remote.bind("pcie0/gpu-a1", "h9", CallContext(epoch=5))),
            (NotFoundError, lambda: remote.set_link("h1", "h2", False)),
        ]
        for error, call in cases:
            with pytest.raises(error):
                call()
        remote.set_link("h3", "top-b", False)
        with pytest.raises(HostUnreachableError):
            remote.bind("pcie0/gpu-b0", "h3", CallContext(epoch=5))

    def test_flaky_bind_is_fabric_unavailable(self, remote: RemoteFabric) -> None:
        remote.flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError, match="injected fault"):
            remote.bind(GPU, "h1", CTX)
        assert remote.bind(GPU, "h1", CTX) == Binding(GPU, "h1")

    def test_deadline_from_the_context(self) -> None:
        sim = pcie(bind_delay_s=1.0)
        with served(sim) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                started = time.monotonic()
                with pytest.raises(DeadlineExceededError):
                    remote.bind(GPU, "h1", CallContext.with_timeout(0.2, epoch=1))
                assert time.monotonic() - started < 0.8
                with pytest.raises(DeadlineExceededError):
                    remote.bind(GPU, "h1", CallContext(epoch=1, deadline=time.monotonic() - 1))
                assert list(sim.bindings()) == []
            finally:
                remote.close()

    def test_endpoint_gone_is_fabric_unavailable_naming_it(self, sim: SimFabric) -> None:
        with served(sim) as server:
            remote = RemoteFabric("pcie0", server.address)
        try:
            with pytest.raises(FabricUnavailableError) as info:
                remote.bind(GPU, "h1", CTX)
            assert server.address in info.value.message
            with pytest.raises(FabricUnavailableError):
                remote.discover()
        finally:
            remote.close()

    @pytest.mark.parametrize(
        "raised",
        [
            LeadershipLostError("lost the lead"),
            RequestIdReusedError("request id 'r' was used for another request"),
            NoFitError("nothing fits"),
            OverloadedError("too busy"),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_an_error_no_driver_raises_is_the_drivers_bug(self, raised: DisaggError) -> None:
        """An error that is the fabric manager's own, raised by a driver, was rebuilt as itself: a bind answered
        LEADERSHIP_LOST told the composer's caller that the fabric manager had lost its lead, and its client went
        to look for another replica. It is a DriverError naming the reason, in doubt as a crashed call's is."""

        class Raising(Plain):
            def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
                raise raised

        with served(Raising(pcie())) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                with pytest.raises(DriverError) as info:
                    remote.bind(GPU, "h1", CTX)
                assert type(info.value) is DriverError and raised.reason in info.value.message
                assert info.value.metadata[OUTCOME] == OUTCOME_UNKNOWN
            finally:
                remote.close()

    def test_driver_bug_is_a_driver_error_without_its_text(self) -> None:
        with served(Secretive(pcie())) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                with pytest.raises(DriverError) as info:
                    remote.bind(GPU, "h1", CTX)
                assert "secret" not in info.value.message and "RuntimeError" in info.value.message
            finally:
                remote.close()

    def test_a_driver_bug_after_the_bind_is_undone_as_in_process(self) -> None:
        """The driver bound, then raised something that is not an SDK error: the answer says the outcome is
        unknown, so the composer's rollback undoes the bind, as it does for a driver in its own process. The
        remote path sent a plain DriverError, and the GPU stayed bound with no composition."""
        sim = pcie()
        with served(BindsThenFails(sim)) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                with pytest.raises(DriverError) as info:
                    remote.bind(GPU, "h1", CTX)
                assert info.value.metadata[OUTCOME] == OUTCOME_UNKNOWN and in_doubt(info.value)
                executor = Executor({"pcie0": remote}, lambda deadline: CTX)
                with pytest.raises(ExecutionFailedError):
                    executor.apply("h2", [("pcie0", DevicePick("pcie0/gpu-a1", 0, 0))], [])
                assert sim.bindings() == (Binding(GPU, "h1"),)
            finally:
                remote.close()

    def test_a_driver_bug_that_cannot_be_printed_is_undone_too(self) -> None:
        """Its incident's log line failed to print it, and the service's fallback answered an InternalError of the
        service's own, with no unknown outcome: the rollback left the GPU bound."""
        sim = pcie()
        with served(BindsThenFailsUnprintably(sim)) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                executor = Executor({"pcie0": remote}, lambda deadline: CTX)
                with pytest.raises(ExecutionFailedError) as failed:
                    executor.apply("h1", [("pcie0", DevicePick(GPU, 0, 0))], [])
                assert isinstance(failed.value.error, DriverError) and "RuntimeError" in failed.value.error.message
                assert "secret" not in failed.value.error.message
                assert sim.bindings() == ()
            finally:
                remote.close()

    def test_a_status_whose_details_contradict_its_code(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """As from a proxy, or a driver in another language with a bug: an SDK error read by the code, with an
        unknown outcome, not the ValueError of grpc_status."""

        def contradicting(self: FabricDriverServicer, request: object, context: grpc.ServicerContext) -> None:
            details = status_pb2.Status(code=code_pb2.NOT_FOUND, message="not this")
            trailing = (("grpc-status-details-bin", details.SerializeToString()),)
            context.abort_with_status(_Status(grpc.StatusCode.FAILED_PRECONDITION, "refused", trailing))

        _bind_in_doubt(monkeypatch, contradicting, ConflictError, "refused")

    def test_a_call_the_drivers_server_cancelled_is_unavailable_in_doubt(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """As grpcio's server answers the calls it is running when it stops (or "Cancelling all calls",
        UNAVAILABLE): the driver went away during the call. It was a bare DisaggError."""

        def cancelled(self: FabricDriverServicer, request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.CANCELLED, "stopping")

        _bind_in_doubt(monkeypatch, cancelled, FabricUnavailableError, "cancelled the call")

    def test_fault_injection_needs_a_fault_injectable_driver(self) -> None:
        with served(Plain(pcie())) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                with pytest.raises(UnsupportedError):
                    remote.fail_device(GPU)
            finally:
                remote.close()


class TestAnUndoAfterALostAnswer:
    """A call whose answer was lost to its deadline may still run in the driver; the undo the composer sends at
    once waits for it there. It overtook the call, found nothing to undo, and the call then left the device
    bound (or the capacity carved) with no composition."""

    def test_a_rollback_waits_for_the_bind_it_undoes(self) -> None:
        sim = pcie()
        driver = HeldBind(sim, 0.5)
        with served(driver) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                executor = Executor({"pcie0": remote}, lambda deadline: CallContext(epoch=1, deadline=deadline))
                with pytest.raises(ExecutionFailedError) as failed:
                    executor.apply("h1", [("pcie0", DevicePick(GPU, 0, 0))], [], deadline=time.monotonic() + 0.2)
                assert failed.value.leftovers == ()
                assert driver.finished.wait(5)
                assert sim.bindings() == ()
            finally:
                remote.close()

    def test_a_release_waits_for_the_allocate_it_undoes(self) -> None:
        sim = cxl()
        driver = HeldAllocate(sim, 0.5)
        with served(driver) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                pool = remote.pool("cxl0/mem0")
                with pytest.raises(DeadlineExceededError) as lost:
                    pool.allocate("a1", "h1", 1 << 30, CallContext.with_timeout(0.2, epoch=1))
                assert in_doubt(lost.value)
                pool.release("a1", CallContext(epoch=1))
                assert driver.finished.wait(5)
                assert list(sim.pool("cxl0/mem0").allocations()) == []
            finally:
                remote.close()

    def test_an_unbind_that_cannot_wait_long_enough_changes_nothing_and_says_so(self) -> None:
        sim = pcie()
        driver = HeldBind(sim, 2.0)
        with served(driver) as server:
            remote = RemoteFabric("pcie0", server.address)
            binding = threading.Thread(target=lambda: remote.bind(GPU, "h1", CallContext.with_timeout(10, epoch=1)))
            binding.start()
            try:
                assert driver.started.wait(5)
                with pytest.raises(DeadlineExceededError, match=f"waited for a bind of {GPU}") as info:
                    remote.unbind(Binding(GPU, "h1"), CallContext.with_timeout(0.6, epoch=1))
                assert info.value.retryable and OUTCOME not in info.value.metadata
                binding.join(10)
                assert sim.bindings() == (Binding(GPU, "h1"),)
                remote.unbind(Binding(GPU, "h1"), CallContext.with_timeout(5, epoch=1))
                assert sim.bindings() == ()
            finally:
                binding.join(10)
                remote.close()


class GarbledDiscovery(Plain):
    """A driver with a bug: its discovery goes through ``garble``."""

    def __init__(self, inner: SimFabric, garble: Callable[[Topology], Topology]) -> None:
        super().__init__(inner)
        self.garble = garble

    def discover(self) -> Topology:
        return self.garble(self.inner.discover())


def _first_device(topology: Topology, **changes: Any) -> Topology:
    return attrs.evolve(topology, devices=(attrs.evolve(topology.devices[0], **changes), *topology.devices[1:]))


class TestAMalformedDiscovery:
    """A discovery naming a device, host, switch, pool or link end by an id the driver service refuses in every
    request (empty, longer than `MAX_ID`, with a space) is the driver's bug: the composer placed such a device, and
    every compose that picked it failed at the bind."""

    @pytest.mark.parametrize(
        ("garble", "field"),
        [
            (lambda t: _first_device(t, id=""), "topology.devices[0].id"),
            (lambda t: _first_device(t, id="pcie0/" + "x" * MAX_ID), "topology.devices[0].id"),
            (
                lambda t: attrs.evolve(t, hosts=(attrs.evolve(t.hosts[0], id="h 1"), *t.hosts[1:])),
                "topology.hosts[0].id",
            ),
            (lambda t: attrs.evolve(t, switches=(attrs.evolve(t.switches[0], id=""),)), "topology.switches[0].id"),
            (lambda t: attrs.evolve(t, links=(*t.links, Link("", "h1", 0))), f"topology.links[{LINKS}].a"),
        ],
        ids=["empty-device", "long-device", "host-with-a-space", "empty-switch", "empty-link-end"],
    )
    def test_it_is_refused_naming_the_entry(self, garble: Callable[[Topology], Topology], field: str) -> None:
        sim = pcie()
        with served(GarbledDiscovery(sim, garble)) as server:
            remote = RemoteFabric("pcie0", server.address, connect_timeout_s=0.5)  # subscribing waits it in vain
            composer = FabricComposer({"pcie0": remote, "cxl0": cxl()}, epoch=1)
            try:
                with pytest.raises(FabricUnavailableError, match=f"malformed topology: {re.escape(field)}"):
                    remote.discover()
                composer.start()  # the other fabric is served; this one is unreachable, its devices offered none
                with pytest.raises(NoFitError):
                    composer.compose(parse_request("job", ["gpu x1"]))
                assert sim.bindings() == ()
            finally:
                composer.close()
                remote.close()


class TestAnAnswerThatIsNotTheCall:
    """A driver that carried a call out but answered something else (another host's binding, another
    allocation id, an empty message): the composer recorded that answer, and later released or unbound what the
    driver never held, while what it did hold stayed with no composition."""

    @pytest.mark.parametrize(
        "answer", [Binding(GPU, "h2"), Binding("pcie0/gpu-a1", "h1"), Binding("", "")], ids=["host", "device", "empty"]
    )
    def test_a_bind_answered_for_another_binding_is_undone(self, answer: Binding) -> None:
        sim = pcie()
        with served(AnswersAnotherBinding(sim, answer)) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                executor = Executor({"pcie0": remote}, lambda deadline: CallContext(epoch=1, deadline=deadline))
                with pytest.raises(ExecutionFailedError) as failed:
                    executor.apply("h1", [("pcie0", DevicePick(GPU, 0, 0))], [])
                assert isinstance(failed.value.error, DriverError)
                assert "answered a bind" in failed.value.error.message
                assert failed.value.leftovers == ()
                assert sim.bindings() == ()
            finally:
                remote.close()

    @pytest.mark.parametrize(
        "answer",
        [
            Allocation("a2", "cxl0/mem0", "h1", 1 << 30),
            Allocation("a1", "cxl0/mem1", "h1", 1 << 30),
            Allocation("a1", "cxl0/mem0", "h2", 1 << 30),
            Allocation("a1", "cxl0/mem0", "h1", 1 << 20),
            Allocation("", "", "", 0),
            Allocation("a1", "cxl0/mem0", "h1", 2**64 - 1),
            Allocation("a1", "cxl0/mem0", "h1", 1 << 30, (Extent(2**41 - (1 << 29), 1 << 30),)),
            Allocation("a1", "cxl0/mem0", "h1", 1 << 30, (Extent(0, 1 << 29), Extent(1 << 28, 1 << 29))),
        ],
        ids=["id", "pool", "host", "less", "empty", "more-than-the-pool", "extent-beyond-the-pool", "extents-overlap"],
    )
    def test_an_allocation_answered_for_another_is_undone(self, answer: Allocation) -> None:
        sim = cxl()
        with served(AnswersAnotherAllocation(sim, answer)) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                with pytest.raises(DriverError, match="answered an allocation") as info:
                    remote.pool("cxl0/mem0").allocate("a1", "h1", 1 << 30, CallContext(epoch=1))
                assert in_doubt(info.value)
                remote.pool("cxl0/mem0").release("a1", CallContext(epoch=1))
                assert list(sim.pool("cxl0/mem0").allocations()) == []
            finally:
                remote.close()

    def test_an_allocation_answered_without_its_pool_is_the_asked_pools(self) -> None:
        """A driver in another language may leave the answer's pool unset, as a listing may (`allocations_from_wire`):
        refused, every allocate such a driver made was undone."""
        sim = cxl()
        with served(AnswersAnotherAllocation(sim, Allocation("a1", "", "h1", 1 << 30))) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                carved = remote.pool("cxl0/mem0").allocate("a1", "h1", 1 << 30, CallContext(epoch=1))
                assert (carved.id, carved.pool, carved.host) == ("a1", "cxl0/mem0", "h1")
            finally:
                remote.close()

    def test_an_allocation_rounded_up_is_the_one_asked_for(self) -> None:
        sim = cxl()
        with served(sim) as server:
            remote = RemoteFabric("cxl0", server.address)
            try:
                carved = remote.pool("cxl0/mem0").allocate("a1", "h1", 1, CallContext(epoch=1))
                assert (carved.id, carved.host) == ("a1", "h1") and carved.amount_bytes >= 1
            finally:
                remote.close()


def refusal(call: Callable[[], object]) -> str:
    """Why ``call`` is refused as unavailable, or "answered"."""
    try:
        call()
    except FabricUnavailableError as exc:
        return exc.message
    return "answered"


class TestADriverOfAnotherFabricAtItsAddress:
    """A driver restarted for another fabric at a fabric's address takes none of its calls, whether it checks the
    fabric a call names or not. Discovery refused it, but unbinds, binds, bindings, capabilities and faults went
    to it: the old binding's undo "succeeded" while the old driver kept it."""

    @staticmethod
    def calls(remote: RemoteFabric, bound: Binding) -> list[Callable[[], object]]:
        return [
            lambda: remote.unbind(bound, CTX),
            lambda: remote.unbind(Binding("pcie0/disagg-fence", "disagg-fence"), CTX),
            remote.bindings,
            remote.capabilities,
            lambda: remote.bind("pcie0/gpu-a1", "h1", CTX),
            remote.discover,
            lambda: remote.fail_device("pcie1/gpu-a0"),
            lambda: remote.flaky_bind(None, 1),
        ]

    @pytest.mark.parametrize("checks", [True, False], ids=["driver-checks-the-fabric", "driver-does-not"])
    def test_every_call_is_refused_as_unavailable(self, checks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        if not checks:  # as a driver in another language that ignores disagg-fabric
            monkeypatch.setattr(FabricDriverServicer, "check_fabric", lambda self, context: None, raising=False)
        directory = tempfile.mkdtemp(prefix="dg-")
        address = f"unix:{directory}/pcie0.sock"
        mine, other = pcie(), create_sim("pcie1", {"topology": "demo-pcie"})
        server = DriverServer(mine, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            bound = remote.bind(GPU, "h1", CTX)
            server.stop(grace=0)
            server = DriverServer(other, address, driver="sim").start()
            assert eventually(lambda: "now serves" in refusal(remote.bindings), 10.0)  # once the channel reconnects
            for call in self.calls(remote, bound):
                with pytest.raises(FabricUnavailableError, match="now serves fabric 'pcie1'"):
                    call()
            assert mine.bindings() == (bound,)
            assert other.bindings() == () and other.device("pcie1/gpu-a0").health() is Health.OK
            assert other.bind("pcie1/gpu-a1", "h1", CTX) == Binding("pcie1/gpu-a1", "h1")  # no flaky bind armed
        finally:
            remote.close()
            server.stop(grace=0)
            shutil.rmtree(directory, ignore_errors=True)

    def test_a_lazy_fabric_that_never_answered_checks_before_any_call(self) -> None:
        """Only its capabilities and discovery checked the fabric served; its other calls went to any driver."""
        directory = tempfile.mkdtemp(prefix="dg-")
        address = f"unix:{directory}/pcie0.sock"
        other = create_sim("pcie1", {"topology": "demo-pcie"})
        remote = RemoteFabric("pcie0", address, connect_timeout_s=0.1, lazy=True)
        server = DriverServer(other, address, driver="sim").start()
        try:

            def answered() -> bool:
                with contextlib.suppress(FabricUnavailableError):
                    remote.capabilities()
                return remote.driver == "sim"

            with pytest.raises(ConfigError, match="serves fabric 'pcie1'"):
                eventually(answered, 10.0)  # the channel reconnects within its backoff (2 s at most)
            for call in self.calls(remote, Binding(GPU, "h1")):
                with pytest.raises(ConfigError, match="serves fabric 'pcie1'"):
                    call()
            assert other.bindings() == () and other.device("pcie1/gpu-a0").health() is Health.OK
        finally:
            remote.close()
            server.stop(grace=0)
            shutil.rmtree(directory, ignore_errors=True)


class TestALateCall:
    """A call whose deadline passed before it was sent reaches a driver that says it judges such calls, and no
    other: one that reads no metadata takes the call's short gRPC timeout for its deadline, and carried it out."""

    @pytest.mark.parametrize("late_calls", [True, False], ids=["judged-by-the-driver", "refused-here"])
    def test_it_reaches_only_a_driver_that_judges_it(self, late_calls: bool) -> None:
        fabric = pcie()
        with serving_bare(YesDriver(fabric, late_calls=late_calls)) as address:
            remote = RemoteFabric("pcie0", address)
            try:
                late = CallContext(epoch=1, deadline=time.monotonic() - 2.0)
                if late_calls:  # this driver says yes to it: the suite's DEADLINE-PASSED fails it
                    remote.bind(GPU, "h1", late)
                    assert list(fabric.bindings()) == [Binding(GPU, "h1")]
                else:
                    with pytest.raises(DeadlineExceededError, match="passed before it was sent"):
                        remote.bind(GPU, "h1", late)
                    assert list(fabric.bindings()) == []
            finally:
                remote.close()

    def test_the_sdks_driver_service_judges_it(self) -> None:
        with served(pcie()) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                with pytest.raises(DeadlineExceededError) as info:
                    remote.bind(GPU, "h1", CallContext(epoch=1, deadline=time.monotonic() - 2.0))
                assert "before it was sent" not in info.value.message  # the driver's own refusal
            finally:
                remote.close()


class TestTheFabricCheck:
    """Every call names its fabric; only a channel that lost its connection asks the endpoint again which fabric
    it serves. Asking before every call would double each call's round trips."""

    def test_a_connected_channel_asks_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        asked: list[bool] = []
        answer = FabricDriverServicer.GetCapabilities

        def counted(self: FabricDriverServicer, request: Any, context: grpc.ServicerContext) -> Any:
            asked.append(True)
            return answer(self, request, context)

        monkeypatch.setattr(FabricDriverServicer, "GetCapabilities", counted)
        with served(pcie()) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                assert connected(remote._channel)
                before = len(asked)
                for epoch in range(1, 21):
                    remote.bind(GPU, "h1", CallContext(epoch=epoch))
                    remote.unbind(Binding(GPU, "h1"), CallContext(epoch=epoch))
                assert len(asked) == before, f"{len(asked) - before} GetCapabilities for 40 calls"
            finally:
                remote.close()


class TestDiscoverCache:
    """Discovery may be cached while the event stream is open, but every event and fault empties the cache."""

    def test_health_and_links_show_at_once(self, remote: RemoteFabric, sim: SimFabric) -> None:
        remote.subscribe(lambda event: None)
        assert remote.discover() is remote.discover()
        remote.fail_device(GPU)
        assert remote.device(GPU).health() is Health.FAILED
        remote.set_link("h1", "top-a", False)
        assert not next(link for link in remote.discover().links if link.a == "h1").up
        sim.repair_device(GPU)  # behind the remote's back: reported by an event, which empties the cache
        deadline = time.monotonic() + 5
        while remote.device(GPU).health() is not Health.OK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remote.device(GPU).health() is Health.OK


class TestADriverDownAtStartUp:
    def test_subscribing_does_not_wait_the_connect_timeout_again(self, tmp_path: Path) -> None:
        """The constructor waited ``connect_timeout_s`` for the driver, then `subscribe` as long again."""
        started = time.monotonic()
        remote = create_fabric("pcie0", {"address": f"unix:{tmp_path / 'nobody.sock'}", "connect_timeout_s": 1})
        try:
            built = time.monotonic()
            remote.subscribe(lambda event: None)
            assert time.monotonic() - built < 0.5, f"the constructor took {built - started:.2f}s"
        finally:
            remote.close()

    def test_the_other_fabrics_are_served_and_it_joins_when_it_answers(self) -> None:
        directory = tempfile.mkdtemp(prefix="dg-")
        address = f"unix:{directory}/pcie0.sock"
        remote = create_fabric("pcie0", {"address": address, "connect_timeout_s": 0.3})
        composer = FabricComposer({"pcie0": remote, "cxl0": cxl()}, epoch=3)
        server = None
        try:
            composer.fence_drivers()
            composer.start()  # stopped with FabricUnavailableError before
            assert composer.compose(parse_request("memory", ["cxl-memory 8GiB"])).composition is not None
            with pytest.raises(NoFitError):
                composer.compose(parse_request("job", ["gpu x1"]))
            sim = pcie()
            server = DriverServer(sim, address, driver="sim").start()
            deadline = time.monotonic() + 10.0  # the channel reconnects within its backoff (2 s at most)
            while not composer.retry_unreachable():  # what the server's timer does every 5 s
                assert time.monotonic() < deadline, "the driver never joined"
                time.sleep(0.2)
            assert sim.epoch == 3
            assert remote.driver == "sim" and remote.capabilities() == SIM_CAPABILITIES
            assert composer.compose(parse_request("job", ["gpu x1"])).composition is not None
        finally:
            composer.close()
            remote.close()
            if server is not None:
                server.stop(grace=0)
            shutil.rmtree(directory, ignore_errors=True)


def _bind_in_doubt(
    monkeypatch: pytest.MonkeyPatch,
    handler: Callable[[FabricDriverServicer, object, grpc.ServicerContext], None],
    error: type[DisaggError],
    match: str,
) -> None:
    """A bind that the driver's ``handler`` answers raises ``error`` (its message matching ``match``) with an
    unknown outcome: the answer did not come from the driver's contract."""
    monkeypatch.setattr(FabricDriverServicer, "Bind", handler)
    with served(pcie()) as server:
        remote = RemoteFabric("pcie0", server.address)
        try:
            with pytest.raises(error, match=match) as info:
                remote.bind(GPU, "h1", CTX)
            assert info.value.metadata[OUTCOME] == OUTCOME_UNKNOWN
        finally:
            remote.close()
