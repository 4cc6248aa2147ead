"""Simulated hardware time (bind_delay_s): calls take that long, and one that cannot finish by its deadline
fails at once with DeadlineExceededError, having changed nothing."""

from __future__ import annotations

import threading
import time

import pytest
from disagg.errors import ConfigError, DeadlineExceededError
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg_sim import SimFabric, load_topology
from sim_helpers import GIB

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
