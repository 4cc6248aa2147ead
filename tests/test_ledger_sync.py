"""Grouped commits in the SQLite ledger: who waits for what, in threads and on an event loop.

`sync` waits for the caller's own writes (and so for everything queued before them), not for writes other
callers queue later; `synced` does the same for an asyncio task; a ledger that cannot be written wakes every
waiter with the error.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.errors import FabricUnavailableError
from disagg.model import Composition, CompositionState, Event, EventType
from disagg.store import SqliteStore


def _composition(cid: str) -> Composition:
    return Composition(id=cid, name=f"name-{cid}", host="h1", state=CompositionState.COMPOSED, resources=())


def _on_disk(path: Path) -> set[str]:
    """The composition ids another connection reads from the database file."""
    with sqlite3.connect(path) as db:
        return {cid for (cid,) in db.execute("SELECT id FROM compositions")}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "ledger.db")
    yield s
    s.close()


class TestSync:
    def test_own_writes_are_on_disk_after_sync(self, store: SqliteStore) -> None:
        for n in range(5):
            store.put_composition(_composition(f"c{n}"))
        store.sync()
        assert _on_disk(store.path) == {f"c{n}" for n in range(5)}

    def test_a_caller_without_writes_does_not_wait_for_others(self, store: SqliteStore) -> None:
        with store._db_lock:  # the committer cannot commit while this is held
            store.put_composition(_composition("mine"))
            other_done = threading.Event()

            def other() -> None:
                store.sync()
                other_done.set()

            worker = threading.Thread(target=other)
            worker.start()
            assert other_done.wait(5), "a thread that wrote nothing waited for another thread's write"
            worker.join()
            assert "mine" not in _on_disk(store.path)
        store.sync()
        assert _on_disk(store.path) == {"mine"}

    def test_writes_to_another_ledger_are_not_waited_for(self, store: SqliteStore, tmp_path: Path) -> None:
        other = SqliteStore(tmp_path / "other.db")
        try:
            for n in range(10):
                other.put_composition(_composition(f"o{n}"))
            other.sync()
            done = threading.Event()
            context = contextvars.copy_context()  # this thread's: its last write went to the other ledger

            def sync_fresh_ledger() -> None:
                store.sync()
                done.set()

            worker = threading.Thread(target=context.run, args=(sync_fresh_ledger,), daemon=True)
            worker.start()
            assert done.wait(5), "sync waited for a sequence number of another ledger"
        finally:
            other.close()

    @pytest.mark.parametrize("after_asynchronous", [False, True], ids=["alone", "after-an-asynchronous-commit"])
    def test_a_writer_waits_for_its_commit(self, store: SqliteStore, after_asynchronous: bool) -> None:
        """Also when its write follows one under `asynchronous_commit`: that one goes along in queue order."""
        synced = threading.Event()
        earlier = {"done"} if after_asynchronous else set()

        def writer() -> None:
            with store.asynchronous_commit():
                for cid in earlier:
                    store.put_composition(_composition(cid))
            store.put_composition(_composition("w"))
            store.sync()
            synced.set()

        with store._db_lock:
            worker = threading.Thread(target=writer)
            worker.start()
            assert not synced.wait(0.3), "sync returned while the committer could not commit"
        assert synced.wait(10)
        worker.join()
        assert _on_disk(store.path) == {"w"} | earlier

    def test_sync_does_not_wait_for_an_asynchronous_commit(self, store: SqliteStore) -> None:
        """Writes under `asynchronous_commit` go to disk with the next group, but the writer's sync waits only
        for what it wrote before them; a write after them is waited for, and takes them along."""
        store.put_composition(_composition("plan"))
        store.sync()
        returned = threading.Event()

        def writer() -> None:
            with store.asynchronous_commit():
                store.put_composition(_composition("done"))
            store.sync()
            returned.set()

        with store._db_lock:  # the committer cannot commit while this is held
            worker = threading.Thread(target=writer)
            worker.start()
            assert returned.wait(5), "sync waited for a write made under asynchronous_commit"
            worker.join()
            assert _on_disk(store.path) == {"plan"}
        store.put_composition(_composition("after"))
        store.sync()
        assert _on_disk(store.path) == {"plan", "done", "after"}

    def test_await_event_waits_until_the_event_is_on_disk(self, store: SqliteStore) -> None:
        store.append_event(Event(1, EventType.DEVICE_CORDONED, "d1", "", 0.0, {}))
        store.sync()
        store.await_event(1)  # on disk already: returns at once
        durable = threading.Event()

        def watcher() -> None:
            store.await_event(2)
            durable.set()

        with store._db_lock:
            store.append_event(Event(2, EventType.DEVICE_CORDONED, "d2", "", 0.0, {}))
            worker = threading.Thread(target=watcher)
            worker.start()
            assert not durable.wait(0.3), "await_event returned for an event not yet on disk"
        assert durable.wait(10)
        worker.join()
        with sqlite3.connect(store.path) as db:
            assert [r for (r,) in db.execute("SELECT revision FROM events ORDER BY revision")] == [1, 2]

    def test_many_writers_each_see_their_write_on_disk(self, store: SqliteStore) -> None:
        missing: list[str] = []

        def writer(n: int) -> None:
            for k in range(20):
                cid = f"c{n}-{k}"
                store.put_composition(_composition(cid))
                store.sync()
                if cid not in _on_disk(store.path):
                    missing.append(cid)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not missing
        assert len(_on_disk(store.path)) == 16 * 20

    def test_a_failed_commit_wakes_every_waiter_with_the_error(self, store: SqliteStore) -> None:
        errors: list[BaseException] = []
        queued = threading.Barrier(5)
        with store._db_lock:  # the failing commit waits until every writer has queued its write
            store._enqueue(lambda batch: batch.prune(("INSERT INTO no_such_table VALUES (1)", ())))

            def writer() -> None:
                store.put_composition(_composition("w"))
                queued.wait(10)
                try:
                    store.sync()
                except FabricUnavailableError as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=writer) for _ in range(4)]
            for t in threads:
                t.start()
            queued.wait(10)
        for t in threads:
            t.join(10)
        assert len(errors) == 4
        with pytest.raises(FabricUnavailableError, match="cannot be written"):
            store.put_composition(_composition("after"))


class TestSynced:
    def test_a_task_awaits_its_commit(self, store: SqliteStore) -> None:
        async def main() -> set[str]:
            async def write(cid: str) -> bool:
                store.put_composition(_composition(cid))
                await store.synced()
                return cid in _on_disk(store.path)

            seen = await asyncio.gather(*(write(f"t{n}") for n in range(32)))
            assert all(seen)
            return _on_disk(store.path)

        assert len(asyncio.run(main())) == 32

    def test_the_loop_runs_while_a_task_waits(self, store: SqliteStore) -> None:
        async def main() -> None:
            ticks = 0
            release = threading.Timer(0.3, store._db_lock.release)
            store._db_lock.acquire()
            store.put_composition(_composition("slow"))
            release.start()
            waiting = asyncio.ensure_future(store.synced())
            while not waiting.done():
                ticks += 1
                await asyncio.sleep(0.01)
            await waiting
            assert ticks >= 10, "the loop was blocked while the task waited for its commit"
            assert _on_disk(store.path) == {"slow"}

        asyncio.run(main())

    def test_a_failed_commit_raises_in_the_task(self, store: SqliteStore) -> None:
        async def main() -> None:
            with store._db_lock:
                store._enqueue(lambda batch: batch.prune(("INSERT INTO no_such_table VALUES (1)", ())))
                store.put_composition(_composition("w"))
                waiting = asyncio.ensure_future(store.synced())
                await asyncio.sleep(0.05)
                assert not waiting.done()
            with pytest.raises(FabricUnavailableError, match="cannot be written"):
                await asyncio.wait_for(waiting, 10)

        asyncio.run(main())

    def test_when_synced_calls_back_once_the_commit_holds_the_writes(self, store: SqliteStore) -> None:
        async def main() -> list[Exception | None]:
            called: list[Exception | None] = []
            assert not store.when_synced(called.append), "nothing written yet, so nothing to wait for"
            with store._db_lock:
                store.put_composition(_composition("cb"))
                assert store.when_synced(called.append)
                await asyncio.sleep(0.05)
                assert called == [], "called back before the commit"
            for _ in range(500):
                if called:
                    break
                await asyncio.sleep(0.01)
            assert _on_disk(store.path) == {"cb"}
            assert not store.when_synced(called.append)
            return called

        assert asyncio.run(main()) == [None]

    def test_when_synced_calls_back_with_the_error_of_a_failed_commit(self, store: SqliteStore) -> None:
        async def main() -> list[Exception | None]:
            called: list[Exception | None] = []
            with store._db_lock:
                store._enqueue(lambda batch: batch.prune(("INSERT INTO no_such_table VALUES (1)", ())))
                assert store.when_synced(called.append)
            for _ in range(500):
                if called:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(FabricUnavailableError, match="cannot be written"):
                store.when_synced(called.append)
            return called

        (failure,) = asyncio.run(main())
        assert isinstance(failure, FabricUnavailableError)

    def test_nothing_written_returns_at_once(self, store: SqliteStore) -> None:
        async def main() -> None:
            with store._db_lock:
                await asyncio.wait_for(store.synced(), 1)

        asyncio.run(main())


class TestTwoLedgersInOneProcess:
    def test_sync_waits_for_this_ledger_s_write_after_one_to_another(self, tmp_path: Path) -> None:
        """The last write a caller queued was kept for all ledgers at once: after a write to a second ledger,
        `sync` of the first returned before the first's write was on disk."""
        first, second = SqliteStore(tmp_path / "first.db"), SqliteStore(tmp_path / "second.db")
        gate = threading.Event()
        commit = first._commit

        def slow(batch: object) -> None:  # the first ledger's commit (its fsync) takes a while
            gate.wait(10)
            commit(batch)  # type: ignore[arg-type]

        first._commit = slow  # type: ignore[method-assign]
        try:
            first.put_composition(_composition("c1"))
            second.put_composition(_composition("c2"))
            timer = threading.Timer(0.2, gate.set)
            timer.start()
            first.sync()
            assert "c1" in _on_disk(tmp_path / "first.db")
        finally:
            gate.set()
            first.close()
            second.close()
