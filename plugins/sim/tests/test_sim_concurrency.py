"""Thread safety: independent work all succeeds; a race for one device has exactly one winner."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

import pytest
from disagg.errors import DeviceBusyError
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg_sim import SimFabric, load_topology
from sim_helpers import GIB


def run_all(jobs: Sequence[Callable[[], object]]) -> list[object]:
    """Run every job on its own thread, started together; returns results or raised exceptions."""
    barrier = threading.Barrier(len(jobs))
    results: list[object] = [None] * len(jobs)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.fixture(params=[0.0, 0.02], ids=["instant", "delayed"])
def fabric(request: pytest.FixtureRequest) -> SimFabric:
    return SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=request.param)


class TestConcurrentBinds:
    """Binds of different devices from many threads all succeed; racing binds of one device do not double."""

    def test_different_devices_all_bind(self, fabric: SimFabric) -> None:
        ctx = CallContext(epoch=1)
        devices = [f"pcie/gpu-{c}{i}" for c in "ab" for i in range(10)]
        hosts = ["h1", "h2"]  # both reach every GPU
        results = run_all([partial(fabric.bind, d, hosts[n % 2], ctx) for n, d in enumerate(devices)])
        assert all(isinstance(r, Binding) for r in results), results
        assert {b.device for b in fabric.bindings()} == set(devices)

    def test_racing_for_one_device_has_one_winner(self, fabric: SimFabric) -> None:
        ctx = CallContext(epoch=1)
        hosts = ["h1", "h2", "h3", "h4"] * 3
        results = run_all([partial(fabric.bind, "pcie/gpu-a0", h, ctx) for h in hosts])
        winners = [r for r in results if isinstance(r, Binding)]
        kinds = Counter(type(r) for r in results)
        winner_host = next(iter(fabric.bindings())).host
        # Threads that asked for the winning host get the same binding back (idempotency); the rest are refused.
        assert {b.host for b in winners} == {winner_host}
        assert len(winners) == hosts.count(winner_host)
        assert kinds[DeviceBusyError] == len(hosts) - len(winners)
        assert list(fabric.bindings()) == [Binding("pcie/gpu-a0", winner_host)]

    def test_racing_distinct_hosts_exactly_one_wins(self, fabric: SimFabric) -> None:
        ctx = CallContext(epoch=1)
        results = run_all([partial(fabric.bind, "pcie/gpu-a3", h, ctx) for h in ("h1", "h2", "h3", "h4")])
        assert sum(isinstance(r, Binding) for r in results) == 1
        assert sum(isinstance(r, DeviceBusyError) for r in results) == 3
        assert len(fabric.bindings()) == 1

    def test_bind_unbind_churn_keeps_state_consistent(self, fabric: SimFabric) -> None:
        ctx = CallContext(epoch=1)

        def churn(host: str) -> int:
            wins = 0
            for _ in range(10):
                try:
                    binding = fabric.bind("pcie/gpu-a5", host, ctx)
                except DeviceBusyError:
                    continue
                wins += 1
                fabric.unbind(binding, ctx)
            return wins

        results = run_all([partial(churn, h) for h in ("h1", "h2", "h3")])
        assert all(isinstance(r, int) for r in results)
        assert fabric.bindings() == ()


class TestConcurrentAllocations:
    """Concurrent allocations never oversubscribe a pool and never overlap."""

    def test_parallel_allocations(self) -> None:
        fabric = SimFabric(load_topology("cxl", "demo-cxl"), bind_delay_s=0.01)
        pool = fabric.pool("cxl/mem0")
        ctx = CallContext(epoch=1)
        # 24 requests of 100 GiB for a 2 TiB pool: 20 fit, 4 do not.
        results = run_all([partial(pool.allocate, f"a{i}", f"h{i % 4 + 1}", 100 * GIB, ctx) for i in range(24)])
        ok = [r for r in results if not isinstance(r, Exception)]
        assert len(ok) == 20
        assert len(pool.allocations()) == 20
        extents = sorted((e.offset, e.end) for a in pool.allocations() for e in a.extents)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(extents))
        assert pool.free_bytes() == 2 * 1024 * GIB - 20 * 100 * GIB
