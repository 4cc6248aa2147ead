"""A ledger whose writes may wait (etcd's: a round trip each, retried while a member stalls) does not stop the
asyncio server's event loop.

The asyncio servicer runs Compose, UpdateComposition and Decompose on its event loop, the ledger's writes
included. The SQLite ledger queues a write for its committer and returns; the etcd ledger makes the round trip
then and there. On the loop, one etcd member that stalled (a slow disk, a pause, a partition) stopped every call
the server answers, health checks included, for the write's patience. Such a change now runs in a thread of
its own (`Store.writes_block`), not one of the RPCs' workers, to its end even if its caller goes away, and the
server's drain waits for it. A read that waited behind a write that then failed is refused, not answered from
what the ledger never took.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from composer_helpers import composer, rack
from disagg.errors import FabricUnavailableError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.requestlang import parse_request
from disagg.server.aio import AsyncFabricManagerServicer
from disagg.server.runtime import WORKERS
from disagg.server.servicer import FabricManagerServicer
from disagg.store import EtcdStore, MemoryStore, SqliteStore
from disagg_sim import create_fabric
from etcd_helpers import EtcdCluster, fresh_prefix, one_etcd_member
from server_helpers import OPEN_CALL, WAIT_S, compose_request, gpu, slow_rack

BIND_S = 1.0
"""How long a bind takes where a test needs a slow one."""
STALL_S = 1.0
"""How long etcd stalls: within the store's write patience, so the write gets through once it is back."""
TICK_S = 0.01
LOOP_STOPPED_S = 0.5
"""A gap between the loop's ticks this long means the loop was stopped (a tick is 10 ms)."""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


@pytest.fixture
def serving(etcd: EtcdCluster) -> Iterator[AsyncFabricManagerServicer]:
    store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), timeout_s=0.5, write_patience_s=3 * STALL_S, unfenced=True)
    with (
        ThreadPoolExecutor(4) as threads,
        composer({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"})}, store=store) as comp,
    ):
        servicer = FabricManagerServicer(comp)
        servicer.mark_ready()
        served = AsyncFabricManagerServicer(servicer, threads)
        yield served
        served.close()


def _compose(serving: AsyncFabricManagerServicer, name: str) -> asyncio.Future[fm.ComposeResponse]:
    return asyncio.ensure_future(serving.Compose(compose_request(name), OPEN_CALL))


def _stall(etcd: EtcdCluster) -> Any:
    process = etcd.members[0].process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    return process


async def _longest_stop(during: asyncio.Future[Any], until: float) -> float:
    """The longest the loop went without running this coroutine's ticks, until ``until`` (monotonic)."""
    longest, last = 0.0, time.monotonic()
    while time.monotonic() < until and not during.done():
        await asyncio.sleep(TICK_S)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


def test_a_stalled_etcd_write_does_not_stop_the_event_loop(
    serving: AsyncFabricManagerServicer, etcd: EtcdCluster
) -> None:
    async def main() -> tuple[float, fm.ComposeResponse]:
        process = _stall(etcd)
        try:
            compose = _compose(serving, "while-etcd-stalls")
            longest = await _longest_stop(compose, time.monotonic() + STALL_S)
        finally:
            process.send_signal(signal.SIGCONT)
        return longest, await asyncio.wait_for(compose, 10)

    longest, answer = asyncio.run(main())
    assert longest < LOOP_STOPPED_S, f"the event loop stood still {longest:.2f} s while etcd stalled"
    assert answer.composition.state == fm.COMPOSITION_STATE_COMPOSED


def test_drain_waits_for_a_change_in_a_worker_thread_whose_caller_went_away(
    serving: AsyncFabricManagerServicer, etcd: EtcdCluster
) -> None:
    async def main() -> tuple[int, int]:
        process = _stall(etcd)
        try:
            compose = _compose(serving, "caller-goes-away")
            await asyncio.sleep(0.2)
            compose.cancel()
            waiting = await serving.drain(0)
        finally:
            process.send_signal(signal.SIGCONT)
        return waiting, await serving.drain(10)

    assert asyncio.run(main()) == (1, 0)
    names = {c.name for c in serving.servicer.composer.compositions()}
    assert names == {"caller-goes-away"}, "the change stopped midway when its caller went away"


def test_changes_waiting_for_a_composition_hold_no_rpc_worker(etcd: EtcdCluster) -> None:
    """Run in the RPCs' workers, changes queued behind a slow one of the same composition took every worker, and
    a read of another composition waited for the slow change to end."""
    store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True)
    with (
        ThreadPoolExecutor(WORKERS) as threads,
        composer(slow_rack(BIND_S), store=store) as comp,
    ):
        busy = comp.compose(parse_request("busy", ["gpu x1"])).composition
        other = comp.compose(parse_request("other", ["gpu x1"])).composition
        assert busy is not None and other is not None
        servicer = FabricManagerServicer(comp)
        servicer.mark_ready()
        serving = AsyncFabricManagerServicer(servicer, threads)

        async def main() -> float:
            grow = fm.UpdateCompositionRequest(id=busy.id, add=[gpu()], etag=busy.etag)
            updates = [asyncio.ensure_future(serving.UpdateComposition(grow, OPEN_CALL)) for _ in range(WORKERS)]
            await asyncio.sleep(BIND_S / 4)  # the first binds, the others wait for it
            started = time.monotonic()
            await serving.GetComposition(fm.GetCompositionRequest(id=other.id), OPEN_CALL)
            took = time.monotonic() - started
            await asyncio.gather(*updates, return_exceptions=True)
            return took

        took = asyncio.run(main())
        serving.close()
    assert took < BIND_S / 2, f"a read of another composition waited {took:.2f} s for a worker"


def test_a_read_behind_a_write_that_failed_is_refused(etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read waits for the composer's lock behind a change, which changes memory before its write; the write
    failed (no member answered within its patience), and the read was answered from memory that the ledger, and
    so the next leader, never held."""
    store = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), timeout_s=0.2, write_patience_s=0.8, unfenced=True)
    with composer(rack(), store=store) as comp:
        job = comp.compose(parse_request("job", ["gpu x1"])).composition
        assert job is not None
        servicer = FabricManagerServicer(comp)
        servicer.mark_ready()
        writing, commit = threading.Event(), store._commit

        def noted(ops: list[dict[str, Any]]) -> None:
            writing.set()
            commit(ops)

        monkeypatch.setattr(store, "_commit", noted)
        process = _stall(etcd)
        try:
            with ThreadPoolExecutor(1) as thread:
                decompose = thread.submit(servicer.Decompose, fm.DecomposeRequest(id=job.id), OPEN_CALL)
                assert writing.wait(WAIT_S)  # the decompose holds the composer's lock, its first write in flight
                with pytest.raises(FabricUnavailableError, match="ledger"):
                    servicer.ListCompositions(fm.ListCompositionsRequest(), OPEN_CALL)
                with pytest.raises(FabricUnavailableError):
                    decompose.result(WAIT_S)
        finally:
            process.send_signal(signal.SIGCONT)
        assert store.failure


def test_which_ledgers_writes_wait(tmp_path: Path, etcd: EtcdCluster) -> None:
    sqlite = SqliteStore(tmp_path / "ledger.db")
    remote = EtcdStore(etcd.endpoints, prefix=fresh_prefix(), unfenced=True)
    try:
        assert [s.writes_block for s in (MemoryStore(), sqlite, remote)] == [False, False, True]
    finally:
        sqlite.close()
        remote.close()
