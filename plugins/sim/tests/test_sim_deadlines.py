"""Simulated hardware time (bind_delay_s): calls take that long, one that cannot finish by its deadline fails
at once with DeadlineExceededError, having changed nothing, and one that changes nothing answers at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from disagg.errors import (
    ConfigError,
    DeadlineExceededError,
    DeviceBusyError,
    FabricUnavailableError,
    HostUnreachableError,
)
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg_sim import SimFabric, load_topology, parse_topology
from disagg_sim.state import SimState
from sim_helpers import GIB, SMALL, in_its_delay

DELAY = 0.1
GPU = "pcie/gpu-a0"


@pytest.fixture
def slow() -> SimFabric:
    return SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=DELAY)


@pytest.fixture
def slow_cxl() -> SimFabric:
    return SimFabric(load_topology("cxl", "demo-cxl"), bind_delay_s=DELAY)


class TestDelay:
    """A bind takes bind_delay_s; a repeat that changes nothing answers at once."""

    def test_bind_takes_the_delay(self, slow: SimFabric) -> None:
        start = time.monotonic()
        slow.bind(GPU, "h1", CallContext(epoch=1, deadline=time.monotonic() + 5))
        assert time.monotonic() - start >= DELAY
        start = time.monotonic()
        slow.bind(GPU, "h1", CallContext(epoch=1))
        assert time.monotonic() - start < DELAY

    def test_binds_of_different_devices_overlap(self, slow: SimFabric) -> None:
        ctx = CallContext(epoch=1)
        threads = [threading.Thread(target=slow.bind, args=(f"pcie/gpu-a{i}", "h1", ctx)) for i in range(8)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(slow.bindings()) == 8
        assert time.monotonic() - start < 8 * DELAY * 0.75  # not one after another under the lock

    def test_discover_does_not_wait_for_a_bind(self) -> None:
        slow_fabric = SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=0.5)
        t = threading.Thread(target=slow_fabric.bind, args=(GPU, "h1", CallContext(epoch=1)))
        t.start()
        time.sleep(0.05)
        start = time.monotonic()
        slow_fabric.discover()
        assert slow_fabric.bindings() == ()  # not yet committed
        assert time.monotonic() - start < 0.1
        t.join()
        assert list(slow_fabric.bindings()) == [Binding(GPU, "h1")]

    def test_a_second_bind_of_a_busy_device_waits_for_the_first(self, slow: SimFabric) -> None:
        ctx = CallContext(epoch=1)
        first = threading.Thread(target=slow.bind, args=(GPU, "h1", ctx))
        first.start()
        time.sleep(DELAY / 5)
        assert slow.bind(GPU, "h1", ctx) == Binding(GPU, "h1")  # waited, then found it bound: a repeat
        first.join()

    def test_an_injected_bind_failure_takes_the_delay(self, slow: SimFabric) -> None:
        """A real device fails a hot-add after the time one takes: so does a bind failed by fault injection, holding
        the device meanwhile, and it changes nothing."""
        slow.flaky_bind(GPU, 1)
        first, outcome = in_background(lambda: slow.bind(GPU, "h1", CallContext(epoch=1)))
        start = time.monotonic()
        in_its_delay(slow, first)
        assert first.is_alive(), "the injected failure answered at once"
        assert slow.bind(GPU, "h2", CallContext(epoch=1)) == Binding(GPU, "h2")  # waited for the failing bind
        first.join()
        assert time.monotonic() - start >= DELAY * 0.8
        assert isinstance(outcome.get("error"), FabricUnavailableError), outcome
        assert list(slow.bindings()) == [Binding(GPU, "h2")]

    def test_negative_delay_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="bind_delay_s"):
            SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=-1)


class TestDeadlines:
    """A call that cannot finish by its deadline raises DeadlineExceededError and changes nothing."""

    def test_bind_too_short_a_deadline(self, slow: SimFabric) -> None:
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"takes 0\.100s"):
            slow.bind(GPU, "h1", CallContext.with_timeout(DELAY / 2, epoch=3))
        assert time.monotonic() - start < DELAY  # fails at once, does not sleep first
        assert slow.bindings() == ()
        assert slow.epoch == 3  # the epoch is remembered even from a call that fails (docs/driver-interface.md)

    def test_expired_deadline(self, pcie: SimFabric) -> None:
        with pytest.raises(DeadlineExceededError):
            pcie.bind(GPU, "h1", CallContext(epoch=1, deadline=time.monotonic() - 1))
        assert pcie.bindings() == ()

    def test_unbind_too_short_a_deadline(self, slow: SimFabric) -> None:
        binding = slow.bind(GPU, "h1", CallContext(epoch=1))
        with pytest.raises(DeadlineExceededError):
            slow.unbind(binding, CallContext.with_timeout(DELAY / 2, epoch=1))
        assert list(slow.bindings()) == [binding]
        slow.unbind(binding, CallContext.with_timeout(5, epoch=1))
        assert slow.bindings() == ()

    def test_allocate_and_release(self, slow_cxl: SimFabric) -> None:
        pool = slow_cxl.pool("cxl/mem0")
        with pytest.raises(DeadlineExceededError):
            pool.allocate("a", "h1", GIB, CallContext.with_timeout(DELAY / 2, epoch=1))
        assert pool.allocations() == ()
        assert pool.free_bytes() == pool.info().capacity.total_bytes
        pool.allocate("a", "h1", GIB, CallContext.with_timeout(5, epoch=1))
        with pytest.raises(DeadlineExceededError):
            pool.release("a", CallContext.with_timeout(DELAY / 2, epoch=1))
        assert [a.id for a in pool.allocations()] == ["a"]

    def test_waiting_for_a_busy_device_honours_the_deadline(self) -> None:
        fabric = SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=0.3)
        first = threading.Thread(target=fabric.bind, args=(GPU, "h1", CallContext(epoch=1)))
        first.start()
        time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            fabric.bind(GPU, "h2", CallContext.with_timeout(0.1, epoch=1))
        assert time.monotonic() - start < 0.25
        first.join()
        assert list(fabric.bindings()) == [Binding(GPU, "h1")]


class TestWaitingForTheLock:
    """A call waits for the fabric's lock no longer than its deadline: behind a slow call holding it (a save of the
    state file on a slow disk), it raises DeadlineExceededError when the deadline passes, having changed nothing,
    rather than waiting for the lock past it."""

    SAVE_S = 0.6

    @pytest.fixture
    def saving(self) -> threading.Event:
        """Set as a slow save begins: the fabric's lock is held until it ends."""
        return threading.Event()

    @pytest.fixture
    def slow_disk(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saving: threading.Event) -> SimFabric:
        fabric = SimFabric(parse_topology("t", SMALL), state_file=tmp_path / "state.json")
        store = fabric._store
        assert store is not None
        save = store.save

        def slow_save(state: SimState) -> None:
            saving.set()
            time.sleep(self.SAVE_S)
            save(state)

        monkeypatch.setattr(store, "save", slow_save)
        return fabric

    @pytest.mark.parametrize("call", ["bind", "unbind", "allocate", "release"])
    def test_behind_a_slow_save(self, slow_disk: SimFabric, saving: threading.Event, call: str) -> None:
        pool = slow_disk.pool("t/dcd")
        calls: dict[str, Callable[[CallContext], object]] = {
            "bind": lambda ctx: slow_disk.bind("t/gpu0", "h1", ctx),
            "unbind": lambda ctx: slow_disk.unbind(Binding("t/gpu1", "h1"), ctx),
            "allocate": lambda ctx: pool.allocate("a", "h1", GIB, ctx),
            "release": lambda ctx: pool.release("b", ctx),
        }
        slow_disk.bind("t/gpu1", "h1", CallContext(epoch=1))
        pool.allocate("b", "h1", GIB, CallContext(epoch=1))
        before = (slow_disk.bindings(), pool.allocations())
        saving.clear()  # set by the saves above
        holder = threading.Thread(target=slow_disk.fail_device, args=("t/gpu2",))  # saves under the lock
        holder.start()
        assert saving.wait(10.0)
        start = time.monotonic()
        try:
            with pytest.raises(DeadlineExceededError, match="deadline passed waiting for the fabric"):
                calls[call](CallContext.with_timeout(0.1, epoch=1))
            waited = time.monotonic() - start
        finally:
            holder.join()
        assert waited < self.SAVE_S / 2, f"waited {waited:.3f}s for a deadline 0.1s away"
        assert (slow_disk.bindings(), pool.allocations()) == before


class TestASleepThatOverruns:
    """The delay fits the deadline, but the sleep runs past it (a loaded machine wakes the thread late): the call
    raises DeadlineExceededError and changes nothing, never answering success once the deadline has passed."""

    @pytest.fixture(autouse=True)
    def late_wakeup(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sleep = time.sleep
        monkeypatch.setattr(time, "sleep", lambda seconds: sleep(seconds + DELAY))

    def test_bind(self, slow: SimFabric) -> None:
        with pytest.raises(DeadlineExceededError, match="passed while"):
            slow.bind(GPU, "h1", CallContext.with_timeout(DELAY * 1.5, epoch=1))
        assert slow.bindings() == ()
        slow.bind(GPU, "h1", CallContext(epoch=1))  # nothing left busy
        assert list(slow.bindings()) == [Binding(GPU, "h1")]

    def test_unbind(self, slow: SimFabric) -> None:
        binding = slow.bind(GPU, "h1", CallContext(epoch=1))
        with pytest.raises(DeadlineExceededError, match="passed while"):
            slow.unbind(binding, CallContext.with_timeout(DELAY * 1.5, epoch=1))
        assert list(slow.bindings()) == [binding]

    def test_allocate_and_release(self, slow_cxl: SimFabric) -> None:
        pool = slow_cxl.pool("cxl/mem0")
        with pytest.raises(DeadlineExceededError, match="passed while"):
            pool.allocate("a", "h1", GIB, CallContext.with_timeout(DELAY * 1.5, epoch=1))
        assert pool.allocations() == ()
        assert pool.free_bytes() == pool.info().capacity.total_bytes
        pool.allocate("a", "h1", GIB, CallContext(epoch=1))
        with pytest.raises(DeadlineExceededError, match="passed while"):
            pool.release("a", CallContext.with_timeout(DELAY * 1.5, epoch=1))
        assert [a.id for a in pool.allocations()] == ["a"]


class TestNoOpsAnswerAtOnce:
    """A call that changes nothing takes no simulated time, so a deadline shorter than the delay is no reason
    to refuse it; the epoch it carries is remembered all the same."""

    def test_fence_unbind_repeat_bind_and_unknown_release(self, slow_cxl: SimFabric) -> None:
        pool = slow_cxl.pool("cxl/mem0")
        pool.allocate("a", "h1", GIB, CallContext(epoch=1))
        start = time.monotonic()
        slow_cxl.unbind(Binding("cxl/disagg-fence", "disagg-fence"), CallContext.with_timeout(DELAY / 2, epoch=2))
        assert slow_cxl.epoch == 2
        assert pool.allocate("a", "h1", GIB, CallContext.with_timeout(DELAY / 2, epoch=2)).id == "a"
        pool.release("unknown", CallContext.with_timeout(DELAY / 2, epoch=2))
        assert time.monotonic() - start < DELAY

    def test_a_repeated_bind(self, slow: SimFabric) -> None:
        binding = slow.bind(GPU, "h1", CallContext(epoch=1))
        assert slow.bind(GPU, "h1", CallContext.with_timeout(DELAY / 2, epoch=1)) == binding

    def test_a_bind_refused_for_its_deadline_leaves_an_injected_fault_pending(self, slow: SimFabric) -> None:
        slow.flaky_bind(GPU, 1)
        with pytest.raises(DeadlineExceededError):
            slow.bind(GPU, "h1", CallContext.with_timeout(DELAY / 2, epoch=1))
        with pytest.raises(FabricUnavailableError, match="injected fault"):
            slow.bind(GPU, "h1", CallContext(epoch=1))


def in_background(call: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Start ``call`` on a thread; the dict gets its ``result`` or its ``error``."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except Exception as exc:  # the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


class TestChangesDuringTheDelay:
    """What a bind or allocate checked before its delay is checked again before it commits: a device failed or
    a link taken down meanwhile fails the call, with the error it would have raised at once, and nothing
    lands."""

    SLOW = 0.5

    def test_the_device_fails(self) -> None:
        fabric = SimFabric(parse_topology("t", SMALL), bind_delay_s=self.SLOW)
        thread, outcome = in_background(lambda: fabric.bind("t/gpu0", "h1", CallContext(epoch=1)))
        time.sleep(self.SLOW / 5)
        fabric.fail_device("t/gpu0", "ECC storm")
        thread.join()
        assert isinstance(outcome.get("error"), DeviceBusyError)
        assert "has FAILED (ECC storm)" in str(outcome["error"])
        assert fabric.bindings() == ()

    def test_the_link_goes_down(self) -> None:
        fabric = SimFabric(parse_topology("t", SMALL), bind_delay_s=self.SLOW)
        thread, outcome = in_background(lambda: fabric.bind("t/gpu0", "h1", CallContext(epoch=1)))
        time.sleep(self.SLOW / 5)
        fabric.set_link("top", "box", False)
        thread.join()
        assert isinstance(outcome.get("error"), HostUnreachableError)
        assert fabric.bindings() == ()
        fabric.set_link("top", "box", True)
        assert fabric.bind("t/gpu0", "h1", CallContext(epoch=1)) == Binding("t/gpu0", "h1")

    def test_the_pool_device_fails(self) -> None:
        fabric = SimFabric(parse_topology("t", SMALL), bind_delay_s=self.SLOW)
        pool = fabric.pool("t/dcd")
        thread, outcome = in_background(lambda: pool.allocate("a", "h1", GIB, CallContext(epoch=1)))
        time.sleep(self.SLOW / 5)
        fabric.fail_device("t/mem0")
        thread.join()
        assert isinstance(outcome.get("error"), DeviceBusyError)
        assert pool.allocations() == ()
        assert pool.free_bytes() == pool.info().capacity.total_bytes
