"""WatchEvents over a real server: the retained log, then live events, in revision order with no gap or
duplicate; OUT_OF_RANGE for a revision the log no longer holds; watches end when the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import composer
from disagg.client import FabricManagerClient, RetryPolicy
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError, RevisionCompactedError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.server import ErrorInterceptor
from disagg.server.aio import AsyncFabricManagerServicer
from disagg.server.runtime import SERVER_OPTIONS
from disagg.server.servicer import FabricManagerServicer
from disagg.server.watch import WATCH_RETRY_S, Watches, watch_events
from disagg.store import MemoryStore, SqliteStore
from disagg.wire.errors import retry_delay_s
from disagg.wire.fabric import WATCH_OPEN
from disagg_sim import create_fabric
from server_helpers import (
    OPEN_CALL,
    WAIT_S,
    FakeContext,
    Served,
    compose_request,
    failure_of,
    serving,
    socket_path,
    stream_fails,
    wait_until,
)

GPUS = [f"pcie0/gpu-a{n}" for n in range(10)]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack on a unix socket in the test's directory."""
    with serving(socket_path(tmp_path)) as running:
        yield running


def churn(served: Served, count: int) -> None:
    """Make ``count`` events (cordons and uncordons)."""
    churn_composer(served.composer, count)


def churn_composer(comp: FabricComposer, count: int) -> None:
    for n in range(count):
        device = GPUS[(n // 2) % len(GPUS)]
        (comp.cordon if n % 2 == 0 else comp.uncordon)(device)


def take(stream: Any, count: int) -> list[int]:
    """The revisions of the next ``count`` events of a stream."""
    return [next(stream).event.revision for _ in range(count)]


def watch(served: Served, after: int = 0) -> Any:
    return served.stub.WatchEvents(fm.WatchEventsRequest(after_revision=after), timeout=WAIT_S)


@pytest.mark.usefixtures("front_end")
class TestWatchEvents:
    """WatchEvents sends the log after a revision, then live events, in revision order with no gap or duplicate."""

    def test_whole_log_then_live(self, served: Served) -> None:
        churn(served, 6)
        stream = watch(served)
        try:
            assert take(stream, 6) == [1, 2, 3, 4, 5, 6]
            comp = served.stub.Compose(compose_request("live")).composition
            events = [next(stream).event for _ in range(2)]
            assert [e.revision for e in events] == [7, 8]
            assert events[0].type == fm.EVENT_TYPE_COMPOSITION_CREATED and events[0].subject == comp.id
            assert events[1].type == fm.EVENT_TYPE_COMPOSITION_STATE_CHANGED and events[1].time > 0
            assert dict(events[1].data) == {"old": "COMPOSING", "new": "COMPOSED"}
        finally:
            stream.cancel()

    def test_resume_from_a_revision(self, served: Served) -> None:
        churn(served, 10)
        stream = watch(served, after=4)
        try:
            assert take(stream, 6) == list(range(5, 11))
            churn(served, 2)
            assert take(stream, 2) == [11, 12]
        finally:
            stream.cancel()

    def test_resume_at_the_newest_revision_waits_for_live_events(self, served: Served) -> None:
        churn(served, 3)
        stream = watch(served, after=3)
        try:
            churn(served, 1)
            assert take(stream, 1) == [4]
        finally:
            stream.cancel()

    def test_events_made_while_the_log_is_read_arrive_once(self, served: Served) -> None:
        churn(served, 50)
        stream = watch(served)
        maker = threading.Thread(target=churn, args=(served, 300))
        maker.start()
        try:
            assert take(stream, 350) == list(range(1, 351))
        finally:
            maker.join(WAIT_S)
            stream.cancel()

    def test_compacted_revision_is_out_of_range(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), store=MemoryStore(event_retention=5)) as served:
            churn(served, 10)
            failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=2))
            assert failed.code is grpc.StatusCode.OUT_OF_RANGE and failed.reason == "REVISION_COMPACTED"
            assert failed.metadata["oldest"] == "6"
            whole = watch(served)
            try:
                assert take(whole, 5) == [6, 7, 8, 9, 10]
            finally:
                whole.cancel()
            resumed = watch(served, after=5)
            try:
                assert take(resumed, 1) == [6]
            finally:
                resumed.cancel()

    def test_revision_ahead_of_the_log_is_out_of_range(self, served: Served) -> None:
        churn(served, 2)
        failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=99))
        assert failed.code is grpc.StatusCode.OUT_OF_RANGE and "ahead" in failed.message
        assert failed.metadata["newest"] == "2"

    @pytest.mark.parametrize("revision", [2**63, 2**64 - 1])
    def test_a_revision_no_ledger_can_hold_is_invalid(self, served: Served, revision: int) -> None:
        """Past int64, which every ledger's revisions are: a bad number, not a reset log."""
        churn(served, 2)
        failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=revision))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("after_revision",)
        assert str(revision) in failed.message and "reset" not in failed.message

    def test_the_highest_revision_a_ledger_can_hold_is_ahead_of_the_log(self, served: Served) -> None:
        failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=2**63 - 1))
        assert failed.code is grpc.StatusCode.OUT_OF_RANGE and "ahead" in failed.message

    def test_too_many_watches_is_resource_exhausted(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), max_watches=2) as served:
            churn(served, 1)
            open_streams = [watch(served) for _ in range(2)]
            try:
                for stream in open_streams:
                    assert take(stream, 1) == [1]
                failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest())
                assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "OVERLOADED"
                open_streams.pop().cancel()
                wait_until(lambda: len(served.server.servicer.watches) == 1, "the cancelled watch to close")
                again = watch(served)
                assert take(again, 1) == [1]
                again.cancel()
            finally:
                for stream in open_streams:
                    stream.cancel()

    def test_a_watch_over_the_limit_is_told_when_to_retry(self, tmp_path: Path) -> None:
        """The refusal carries a ``google.rpc.RetryInfo`` of `WATCH_RETRY_S` to twice that, which the client waits
        before it opens the watch again, rather than its own backoff of milliseconds: at the limit, a hundred
        clients retrying at once would each be refused again."""
        with serving(socket_path(tmp_path), max_watches=1) as served:
            churn(served, 1)
            held = watch(served)
            assert take(held, 1) == [1]
            with pytest.raises(grpc.RpcError) as info:
                next(watch(served))
            asked = retry_delay_s(info.value)
            assert asked is not None and WATCH_RETRY_S <= asked <= 2 * WATCH_RETRY_S
            quick = RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.001)
            with FabricManagerClient(served.address, timeout_s=WAIT_S, retries=quick) as client:
                started = time.monotonic()
                stream = client.watch()
                threading.Timer(0.1, held.cancel).start()
                assert next(stream).revision == 1
                waited = time.monotonic() - started
                stream.close()
            assert WATCH_RETRY_S <= waited < WAIT_S

    def test_cancel_releases_the_watch(self, served: Served) -> None:
        churn(served, 1)
        stream = watch(served)
        assert take(stream, 1) == [1]
        stream.cancel()
        wait_until(lambda: len(served.server.servicer.watches) == 0, "the watch to close")
        churn(served, 1)  # the composer no longer calls the closed watch's buffer

    def test_server_stop_ends_the_watch_with_unavailable(self, tmp_path: Path, front_end: str) -> None:
        """At once, not when the grace runs out, with either front end."""
        with serving(socket_path(tmp_path), front_end=front_end) as served:
            churn(served, 1)
            stream = watch(served)
            assert take(stream, 1) == [1]
            stopper = threading.Thread(target=served.server.stop, args=(WAIT_S,))
            started = time.monotonic()
            stopper.start()
            try:
                with pytest.raises(grpc.RpcError) as info:
                    next(stream)
                failed = failure_of(info.value)
                assert failed.code is grpc.StatusCode.UNAVAILABLE and "revision 1" in failed.message
            finally:
                stopper.join(WAIT_S)
            assert not stopper.is_alive() and time.monotonic() - started < WAIT_S / 2, "the stop waited its grace"


@pytest.mark.usefixtures("front_end")
class TestSlowWatcher:
    """A watcher that stops reading keeps no slot: once a send has waited `watch_stall_s`, its watch ends and the
    client, when it reads again, gets what was sent and then OVERLOADED saying where to resume."""

    def test_a_stalled_watch_frees_its_slot_and_is_told(self, tmp_path: Path, front_end: str) -> None:
        """With the front end in a process of its own too: it passes a message on only as gRPC takes it, so the
        composer's send waits for a client that stopped reading, and the stall is caught there."""
        with serving(socket_path(tmp_path), max_watches=1, front_end=front_end) as served:
            served.server.servicer.watch_stall_s = 0.5
            churn(served, 3000)  # more than the connection's flow-control window holds
            # No bandwidth probing: the window stays at its first 64 KiB, as for a client that does not read.
            with grpc.insecure_channel(served.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
                stalled = fm_grpc.FabricManagerServiceStub(channel).WatchEvents(
                    fm.WatchEventsRequest(), timeout=WAIT_S * 3
                )
                assert take(stalled, 1) == [1]
                wait_until(lambda: len(served.server.servicer.watches) == 0, "the stalled watch to be dropped")
                other = watch(served, after=2999)
                assert take(other, 1) == [3000]
                other.cancel()
                read = [1]
                with pytest.raises(grpc.RpcError) as info:
                    for msg in stalled:
                        read.append(msg.event.revision)
                failed = failure_of(info.value)
                assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "OVERLOADED"
                assert read == list(range(1, len(read) + 1)) and len(read) < 3000
                assert failed.metadata["revision"] == str(read[-1]) and f"revision {read[-1]}" in failed.message


@contextlib.contextmanager
def embedded(tmp_path: Path, servicer: FabricManagerServicer) -> Iterator[str]:
    """``servicer`` on a thread-pool server as docs/protocol.md embeds it; yields its address."""
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
    fm_grpc.add_FabricManagerServiceServicer_to_server(servicer, server)
    address = f"unix:{socket_path(tmp_path)}"
    server.add_insecure_port(address)
    server.start()
    servicer.mark_ready()
    try:
        yield address
    finally:
        servicer.stop()
        server.stop(0).wait(WAIT_S)


class TestAServedWatchIsTold:
    """The server tells a client its watch is served (`WATCH_OPEN` in the initial metadata) before any event, so that
    a client can tell the break of a served watch from a failed reopen; a watch it refuses is not told so."""

    def _told(self, stub: fm_grpc.FabricManagerServiceStub, after: int) -> bool:
        call = stub.WatchEvents(fm.WatchEventsRequest(after_revision=after), timeout=WAIT_S)
        try:
            return WATCH_OPEN in (call.initial_metadata() or ())
        finally:
            call.cancel()

    @pytest.mark.usefixtures("front_end")
    def test_on_the_asyncio_server(self, served: Served) -> None:
        churn(served, 2)
        assert self._told(served.stub, 2)  # at the newest revision: no event to send yet
        assert not self._told(served.stub, 9)  # ahead of the log: refused

    def test_on_a_thread_pool_server(self, tmp_path: Path) -> None:
        comp = composer()
        servicer = FabricManagerServicer(comp)
        try:
            churn_composer(comp, 2)
            with embedded(tmp_path, servicer) as address, grpc.insecure_channel(address) as channel:
                stub = fm_grpc.FabricManagerServiceStub(channel)
                assert self._told(stub, 2)
                assert not self._told(stub, 9)
        finally:
            comp.close()


class TestSlowWatcherOnAThreadPoolServer:
    """On a thread-pool server (the servicer embedded, docs/protocol.md) a watcher that stops reading keeps neither
    its slot nor its worker thread: once a send has waited `watch_stall_s` the call is cancelled (grpcio's worker
    waits in that send until the client reads, and no status gets past the events queued before it), and the Python
    client resumes from the last event it read. It held both for as long as the client's connection lived."""

    def test_a_stalled_watch_frees_its_slot_and_its_thread(self, tmp_path: Path) -> None:
        comp = composer()
        servicer = FabricManagerServicer(comp, max_watches=1, watch_stall_s=0.5)
        try:
            for n in range(3000):  # more than the connection's flow-control window holds
                device = GPUS[(n // 2) % len(GPUS)]
                (comp.cordon if n % 2 == 0 else comp.uncordon)(device)
            with (
                embedded(tmp_path, servicer) as address,
                grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel,
            ):
                stalled = fm_grpc.FabricManagerServiceStub(channel).WatchEvents(
                    fm.WatchEventsRequest(), timeout=WAIT_S * 3
                )
                assert take(stalled, 1) == [1]
                wait_until(lambda: len(servicer.watches) == 0, "the stalled watch to be dropped")
                with grpc.insecure_channel(address) as other_channel:
                    other = fm_grpc.FabricManagerServiceStub(other_channel).WatchEvents(
                        fm.WatchEventsRequest(after_revision=2999), timeout=WAIT_S
                    )
                    assert take(other, 1) == [3000]
                    other.cancel()
                read = [1]
                with pytest.raises(grpc.RpcError) as info:
                    for msg in stalled:
                        read.append(msg.event.revision)
                assert info.value.code() is grpc.StatusCode.CANCELLED
                assert read == list(range(1, len(read) + 1)) and len(read) < 3000
        finally:
            comp.close()

    def test_the_client_resumes_a_watch_cancelled_for_a_stall(self, tmp_path: Path) -> None:
        comp = composer()
        servicer = FabricManagerServicer(comp, max_watches=1, watch_stall_s=0.5)
        try:
            for n in range(3000):
                device = GPUS[(n // 2) % len(GPUS)]
                (comp.cordon if n % 2 == 0 else comp.uncordon)(device)
            fast = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
            with embedded(tmp_path, servicer) as address:
                # No bandwidth probing: the window stays at its first 64 KiB, as for a client that does not read.
                channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
                with FabricManagerClient(address, retries=fast, channel=channel) as client:
                    stream = client.watch()
                    assert next(stream).revision == 1
                    wait_until(lambda: len(servicer.watches) == 0, "the stalled watch to be dropped")
                    revisions = [event.revision for _, event in zip(range(2999), stream, strict=False)]
                    stream.close()
            assert revisions == list(range(2, 3001))
        finally:
            comp.close()


@pytest.mark.usefixtures("front_end")
class TestAWatchItsClientLeft:
    """A client that goes away while a send of its watch waits is an ordinary end of the call: the watch closes,
    and the server logs no error for it (grpcio logged ExecuteBatchError with a traceback)."""

    def test_a_client_gone_mid_send_logs_no_error(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with serving(socket_path(tmp_path)) as served:
            churn(served, 3000)  # more than the connection's flow-control window holds: a send waits
            sending: list[int] = []
            store = served.composer.store
            monkeypatch.setattr(store, "await_event", sending.append)  # in memory: each is held already
            channel = grpc.insecure_channel(served.address, options=[("grpc.http2.bdp_probe", 0)])
            stream = fm_grpc.FabricManagerServiceStub(channel).WatchEvents(fm.WatchEventsRequest(), timeout=WAIT_S)
            assert take(stream, 1) == [1]
            wait_until(lambda: _stopped_sending(sending), "a send of the watch to wait for its client")
            channel.close()
            wait_until(lambda: len(served.server.servicer.watches) == 0, "the watch of the client gone to close")
        errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
        assert errors == []


def _stopped_sending(sending: list[int], still_s: float = 0.3) -> bool:
    """Whether a watch that sent the revisions ``sending`` stands still, short of the last: a send waits."""
    before = len(sending)
    time.sleep(still_s)
    return 0 < len(sending) == before and sending[-1] < 3000


class TestWatchBuffer:
    """A watcher that falls behind loses nothing: what its full buffer dropped is read from the log."""

    def test_overflow_is_read_from_the_log(self) -> None:
        comp = composer()
        comp.cordon(GPUS[0])
        context = FakeContext()
        watches = Watches(4)
        events = watch_events(comp, 0, context, watches, capacity=2)  # type: ignore[arg-type]
        assert next(events).revision == 1
        for n in range(40):
            (comp.uncordon if n % 2 == 0 else comp.cordon)(GPUS[0])
        revisions = [next(events).revision for _ in range(40)]
        assert revisions == list(range(2, 42))
        context.cancel()
        assert list(events) == [] and len(watches) == 0

    def test_gap_in_the_log_is_refused(self) -> None:
        comp = composer(store=MemoryStore(event_retention=3))
        context = FakeContext()
        events = watch_events(comp, 0, context, Watches(4), capacity=2)  # type: ignore[arg-type]
        comp.cordon(GPUS[0])
        assert next(events).revision == 1
        for n in range(10):  # the buffer overflows and the log keeps only the last three
            (comp.uncordon if n % 2 == 0 else comp.cordon)(GPUS[0])
        with pytest.raises(RevisionCompactedError, match="events 2 to 8 are no longer retained"):
            list(events)

    def test_one_event_no_longer_retained_is_named_as_one(self) -> None:
        """A watch one event short of the retained log was told "events 5 to 5 are no longer retained"."""
        comp = composer(store=MemoryStore(event_retention=5))
        churn_composer(comp, 10)
        with pytest.raises(RevisionCompactedError) as refused:
            next(watch_events(comp, 4, FakeContext(), Watches(4)))  # type: ignore[arg-type]
        assert refused.value.message.startswith("event 5 is no longer retained; the oldest is 6:")
        comp.close()

    def test_stopping_ends_watches_and_refuses_new_ones(self) -> None:
        comp = composer()
        watches = Watches(4)
        events = watch_events(comp, 0, FakeContext(), watches)  # type: ignore[arg-type]
        comp.cordon(GPUS[0])
        assert next(events).revision == 1
        watches.stop()
        with pytest.raises(FabricUnavailableError, match="shutting down; watch again from revision 1"):
            next(events)
        with pytest.raises(FabricUnavailableError, match="shutting down"):
            next(watch_events(comp, 0, FakeContext(), watches))  # type: ignore[arg-type]


class TestWatchAcrossARestart:
    """With the durable ledger, a watch resumes from a revision across a server restart with no gap and no
    duplicate, and a revision the ledger has compacted away is refused with OUT_OF_RANGE."""

    def test_an_event_is_sent_once_it_is_on_disk(self, tmp_path: Path) -> None:
        """A live event reaches a watch as it is made, before its commit; the watch sends it only once the
        ledger holds it, so that no crash can take back an event a watcher has seen."""
        store = SqliteStore(tmp_path / "l.db")
        comp = composer(store=store)
        context = FakeContext()
        sent: list[int] = []
        got = [threading.Event(), threading.Event()]

        def watcher() -> None:
            for event in watch_events(comp, 0, context, Watches(4)):  # type: ignore[arg-type]
                sent.append(event.revision)
                got[event.revision - 1].set()

        watching = threading.Thread(target=watcher, daemon=True)
        watching.start()
        changer = threading.Thread(target=comp.cordon, args=(GPUS[0],), daemon=True)
        try:
            comp.cordon(GPUS[1])
            assert got[0].wait(WAIT_S)  # the watch is past the log, waiting for live events
            with store._db_lock:  # the committer cannot commit while this is held
                changer.start()
                wait_until(lambda: comp.revision == 2, "the second cordon's event")
                assert not got[1].wait(0.3), "the watch sent an event that is not on disk"
            assert got[1].wait(WAIT_S)
            assert sent == [1, 2]
        finally:
            context.cancel()
            watching.join(WAIT_S)
            changer.join(WAIT_S)
            comp.close()

    @pytest.mark.usefixtures("front_end")
    def test_resume_after_a_restart(self, tmp_path: Path) -> None:
        hardware = {"pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "p.json")})}
        with serving(socket_path(tmp_path), hardware, store=SqliteStore(tmp_path / "l.db")) as served:
            churn(served, 3)
            seen = served.composer.revision
        hardware = {"pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "p.json")})}
        with serving(socket_path(tmp_path), hardware, store=SqliteStore(tmp_path / "l.db")) as served:
            assert served.composer.revision == seen
            resumed = watch(served, after=seen - 2)
            try:
                assert take(resumed, 2) == [seen - 1, seen]
                churn(served, 1)
                assert take(resumed, 1) == [seen + 1]
            finally:
                resumed.cancel()

    @pytest.mark.usefixtures("front_end")
    def test_compacted_after_a_restart(self, tmp_path: Path) -> None:
        ledger = tmp_path / "l.db"
        hardware = {"pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "p.json")})}
        with serving(socket_path(tmp_path), hardware, store=SqliteStore(ledger, event_retention=4)) as s:
            churn(s, 9)
        kept = SqliteStore(ledger, event_retention=4)
        oldest = kept.events_after(0, 1)[0].revision
        kept.close()
        assert oldest > 2  # the log was pruned to about the retention
        hardware = {"pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "p.json")})}
        with serving(socket_path(tmp_path), hardware, store=SqliteStore(ledger, event_retention=4)) as s:
            failed = stream_fails(s.stub.WatchEvents, fm.WatchEventsRequest(after_revision=1))
            assert failed.code is grpc.StatusCode.OUT_OF_RANGE and failed.reason == "REVISION_COMPACTED"
            assert failed.metadata["oldest"] == str(oldest)

    @pytest.mark.parametrize("ledger", ["sqlite", "memory"])
    @pytest.mark.usefixtures("front_end")
    def test_a_resume_over_a_log_reset_since_is_refused(self, tmp_path: Path, ledger: str) -> None:
        """The ledger restored from a backup of revision 3 (as docs/durability.md describes), or an in-memory
        one restarted: once the new log passed the client's revision, the Python client's resume from 6 went
        on at 7, and the new events up to 6 never came. Its resume now carries the time of event 6, which the
        new log's event 6 does not have: OUT_OF_RANGE, and the client lists again."""

        def store() -> SqliteStore | MemoryStore:
            return SqliteStore(tmp_path / "l.db") if ledger == "sqlite" else MemoryStore()

        with serving(socket_path(tmp_path), store=store()) as first:
            churn(first, 3)
            if ledger == "sqlite":
                with (
                    contextlib.closing(sqlite3.connect(tmp_path / "l.db")) as live,
                    contextlib.closing(sqlite3.connect(tmp_path / "backup.db")) as backup,
                ):
                    live.backup(backup)
            first.composer.uncordon(GPUS[1])
            first.composer.cordon(GPUS[2])
            first.composer.uncordon(GPUS[2])
            client = FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S)
            stream = client.watch(0)
            assert [next(stream).revision for _ in range(6)] == [1, 2, 3, 4, 5, 6]
        if ledger == "sqlite":
            shutil.copy(tmp_path / "backup.db", tmp_path / "l.db")
            for suffix in ("-wal", "-shm"):
                (tmp_path / f"l.db{suffix}").unlink(missing_ok=True)
        try:
            with serving(socket_path(tmp_path), store=store()) as second:
                churn(second, 8)
                assert second.composer.revision > 6
                with pytest.raises(RevisionCompactedError, match="reset or restored since revision 6"):
                    next(stream)
        finally:
            stream.close()
            client.close()

    @pytest.mark.usefixtures("front_end")
    def test_a_resume_on_the_same_log_goes_on(self, tmp_path: Path) -> None:
        """The check compares the event the client saw with the one the log holds: on the same log, across a
        restart, the resume goes on with no gap and no duplicate."""
        with serving(socket_path(tmp_path), store=SqliteStore(tmp_path / "l.db")) as first:
            churn(first, 3)
            client = FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S)
            stream = client.watch(0)
            assert [next(stream).revision for _ in range(3)] == [1, 2, 3]
        try:
            with serving(socket_path(tmp_path), store=SqliteStore(tmp_path / "l.db")) as second:
                churn(second, 2)
                assert [next(stream).revision for _ in range(2)] == [4, 5]
        finally:
            stream.close()
            client.close()

    @pytest.mark.usefixtures("front_end")
    def test_a_quiet_watch_outlives_more_restarts_than_its_attempts(self, tmp_path: Path) -> None:
        """A watch that sees no event while its server restarts again and again, coming back each time: the
        breaks were counted in a row, as a call's failed attempts are, and the restart that made them the
        policy's ``max_attempts`` ended the watch with UNAVAILABLE, though each reopen was served. A break of a
        watch the server had opened is the first of a new row."""
        ledger = tmp_path / "l.db"
        policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.4, max_backoff_s=0.4, multiplier=1.0)
        got: list[object] = []

        def read(stream: Any) -> None:
            try:
                got.append(next(stream).revision)
            except Exception as exc:  # what ended the watch is what the test reports
                got.append(exc)

        with serving(socket_path(tmp_path), store=SqliteStore(ledger)) as first:
            churn(first, 1)
            client = FabricManagerClient(first.address, timeout_s=WAIT_S, retries=policy)
            client._rng = _Longest()  # each restart's pause covers the server's downtime: the break alone counts
            stream = client.watch(1)
            reader = threading.Thread(target=read, args=(stream,))
            reader.start()
            wait_until(lambda: len(first.server.servicer.watches) == 1, "the watch to open")
        try:
            for restart in range(policy.max_attempts + 1):
                with serving(socket_path(tmp_path), store=SqliteStore(ledger)) as again:
                    wait_until(lambda: len(again.server.servicer.watches) == 1 or bool(got), "the watch to reopen")
                    assert got == [], f"ended at restart {restart + 1}"
            with serving(socket_path(tmp_path), store=SqliteStore(ledger)) as last:
                wait_until(lambda: len(last.server.servicer.watches) == 1 or bool(got), "the watch to reopen")
                last.composer.uncordon(GPUS[0])
                reader.join(WAIT_S)
            assert got == [2]
        finally:
            stream.close()
            reader.join(WAIT_S)
            client.close()

    @pytest.mark.parametrize("when", [float("nan"), float("inf"), -1.0])
    @pytest.mark.usefixtures("front_end")
    def test_a_time_that_is_no_time_is_refused(self, served: Served, when: float) -> None:
        churn(served, 2)
        failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=1, after_time=when))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("after_time",)


RETAINED = 4
"""The event retention of the ledgers of `TestAResumeAtTheEdgeOfTheRetention`."""


def retaining(tmp_path: Path, ledger: str, name: str) -> SqliteStore | MemoryStore:
    """A ledger that keeps the newest `RETAINED` events: a new in-memory one, or a new SQLite file ``name``."""
    if ledger == "memory":
        return MemoryStore(event_retention=RETAINED)
    return SqliteStore(tmp_path / f"{name}.db", event_retention=RETAINED)


def resume(after: int, after_time: float) -> fm.WatchEventsRequest:
    return fm.WatchEventsRequest(after_revision=after, after_time=after_time)


@pytest.mark.parametrize("ledger", ["sqlite", "memory"])
@pytest.mark.usefixtures("front_end")
class TestAResumeAtTheEdgeOfTheRetention:
    """A log that keeps the newest 4 events: after 9, it serves 6 to 9. A resume from 5 has no gap, but the log
    no longer holds event 5 to hold the client's time against: over a reset log it went on with the new log's
    events as if they followed the client's."""

    @pytest.mark.parametrize("after", [4, 5, 6, 9])
    def test_a_resume_over_a_reset_is_refused(self, tmp_path: Path, ledger: str, after: int) -> None:
        """From below the oldest retained (a gap), just below it, the oldest itself and the newest."""
        first_log = MemoryStore() if ledger == "memory" else SqliteStore(tmp_path / "first.db")
        with serving(socket_path(tmp_path), store=first_log) as first:
            churn(first, 9)
            seen = first.composer.events(after - 1, 1)[0]
        with serving(socket_path(tmp_path), store=retaining(tmp_path, ledger, "second")) as second:
            churn(second, 9)
            assert second.composer.events(0, 1)[0].revision == 6
            failed = stream_fails(second.stub.WatchEvents, resume(after, seen.time))
        assert failed.code is grpc.StatusCode.OUT_OF_RANGE and failed.reason == "REVISION_COMPACTED"

    def test_a_resume_from_the_oldest_retained_goes_on(self, tmp_path: Path, ledger: str) -> None:
        with serving(socket_path(tmp_path), store=retaining(tmp_path, ledger, "l")) as served:
            churn(served, 9)
            oldest = served.composer.events(0, 1)[0]
            stream = served.stub.WatchEvents(resume(oldest.revision, oldest.time), timeout=WAIT_S)
            try:
                assert take(stream, 3) == [7, 8, 9]
            finally:
                stream.cancel()

    def test_a_resume_from_the_newest_goes_on(self, tmp_path: Path, ledger: str) -> None:
        with serving(socket_path(tmp_path), store=retaining(tmp_path, ledger, "l")) as served:
            churn(served, 9)
            newest = served.composer.events(8, 1)[0]
            stream = served.stub.WatchEvents(resume(9, newest.time), timeout=WAIT_S)
            try:
                churn(served, 1)
                assert take(stream, 1) == [10]
            finally:
                stream.cancel()

    def test_a_resume_from_just_below_the_oldest_retained(self, tmp_path: Path, ledger: str) -> None:
        """With its time, it cannot be told from one over a reset log, and is refused the same way, naming the
        oldest event retained; without one (not checked), it goes on with no gap."""
        with serving(socket_path(tmp_path), store=retaining(tmp_path, ledger, "l")) as served:
            churn(served, 5)
            fifth = served.composer.events(4, 1)[0]
            churn(served, 4)
            failed = stream_fails(served.stub.WatchEvents, resume(5, fifth.time))
            assert failed.code is grpc.StatusCode.OUT_OF_RANGE and failed.reason == "REVISION_COMPACTED"
            assert failed.metadata["oldest"] == "6"
            stream = served.stub.WatchEvents(resume(5, 0.0), timeout=WAIT_S)
            try:
                assert take(stream, 4) == [6, 7, 8, 9]
            finally:
                stream.cancel()

    def test_a_resume_from_further_below_is_refused(self, tmp_path: Path, ledger: str) -> None:
        with serving(socket_path(tmp_path), store=retaining(tmp_path, ledger, "l")) as served:
            churn(served, 9)
            failed = stream_fails(served.stub.WatchEvents, resume(4, 0.0))
            assert failed.code is grpc.StatusCode.OUT_OF_RANGE and failed.metadata["oldest"] == "6"


@pytest.mark.usefixtures("front_end")
class TestWatchFromAListing:
    """A listing's revision carries the time of its event (`revision_time`), which a watch from it sends."""

    @pytest.mark.parametrize(
        "listing",
        ["compositions_at", "reservations_at", "devices_at", "device_statuses_at", "topologies_at", "usage_at"],
    )
    def test_a_watch_from_a_listing_of_a_log_reset_since_is_refused(self, tmp_path: Path, listing: str) -> None:
        """An in-memory ledger restarted after the listing: once the new log passes the listing's revision, a
        watch from it went on at the next revision, and the client never saw the new log's earlier changes
        (the new compositions among them). The listing's time, sent with the watch, is not the new log's."""
        with serving(socket_path(tmp_path), store=MemoryStore()) as first:
            churn(first, 3)
            with FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S) as client:
                _, revision = getattr(client, listing)()
        assert revision == 3 and revision.time > 0
        with serving(socket_path(tmp_path), store=MemoryStore()) as second:
            churn(second, 5)
            with FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S) as client:
                stream = client.watch(revision)
                with pytest.raises(RevisionCompactedError, match="reset or restored since revision 3"):
                    next(stream)

    def test_a_watch_from_a_listing_on_the_same_log_goes_on(self, tmp_path: Path) -> None:
        """Across a restart on the same ledger, the listing's revision still names its event: the watch follows
        on from it with no gap and no duplicate."""
        with serving(socket_path(tmp_path), store=SqliteStore(tmp_path / "l.db")) as first:
            churn(first, 3)
            with FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S) as client:
                _, revision = client.compositions_at()
        with serving(socket_path(tmp_path), store=SqliteStore(tmp_path / "l.db")) as second:
            churn(second, 2)
            with FabricManagerClient(f"unix:{socket_path(tmp_path)}", timeout_s=WAIT_S) as client:
                stream = client.watch(revision)
                try:
                    assert [next(stream).revision for _ in range(2)] == [4, 5]
                finally:
                    stream.close()

    def test_an_empty_log_has_no_time(self, served: Served) -> None:
        """Before the first event there is no event to name: revision 0, time 0, and a watch of the whole log."""
        response = served.stub.ListCompositions(fm.ListCompositionsRequest(), timeout=WAIT_S)
        assert (response.revision, response.revision_time) == (0, 0.0)


class _Longest(random.Random):
    """Pauses as long as the policy allows, every time."""

    def uniform(self, a: float, b: float) -> float:
        return b


class _StoppedAsItOpens(FakeContext):
    """The server stops (`Watches.stop`) just after the watch took its slot, before it read the log."""

    def __init__(self, watches: Watches) -> None:
        super().__init__()
        self.watches = watches

    def add_callback(self, callback: Any) -> bool:
        self.watches.stop()
        return super().add_callback(callback)


class TestAWatchEndedEarly:
    def test_one_stopped_before_it_sent_anything_resumes_where_it_began(self) -> None:
        """A watch from 0 stopped before it read the log said to watch again from the newest revision: a client
        that did so never saw the events before it."""
        comp = composer()
        for n in range(5):
            (comp.cordon if n % 2 == 0 else comp.uncordon)("pcie0/gpu-a0")
        watches = Watches(4)
        sent = []
        with pytest.raises(FabricUnavailableError) as stopped:
            for event in watch_events(comp, 0, _StoppedAsItOpens(watches), watches):  # type: ignore[arg-type]
                sent.append(event.revision)
        assert sent == [] and stopped.value.metadata["revision"] == "0"
        comp.close()

    @pytest.fixture
    def on_a_loop(self) -> Iterator[tuple[FabricComposer, AsyncFabricManagerServicer, ThreadPoolExecutor]]:
        """A composer with one event (a cordon), served by the asyncio servicer on worker threads of its own."""
        comp = composer()
        comp.cordon("pcie0/gpu-a0")
        servicer = FabricManagerServicer(comp)
        servicer.mark_ready()
        threads = ThreadPoolExecutor(4)
        aio = AsyncFabricManagerServicer(servicer, threads)
        yield comp, aio, threads
        threads.shutdown(wait=True)
        aio.close()
        comp.close()

    def test_a_cancelled_watch_closes_without_the_event_loop_waiting_for_the_composer(
        self, on_a_loop: tuple[FabricComposer, AsyncFabricManagerServicer, ThreadPoolExecutor]
    ) -> None:
        """Closing a watch stops its listening, under the composer's lock, which a change may hold through a ledger
        write that waits (etcd's): closed on the event loop, it stood the loop still, every call with it."""
        comp, aio, _ = on_a_loop
        held, release, gave_up = threading.Event(), threading.Event(), threading.Event()

        def change_holding_the_lock() -> None:
            with comp._lock:
                held.set()
                if not release.wait(WAIT_S):
                    gave_up.set()  # still holding the lock: whoever waited for it gets it only after this

        async def cancel_while_held() -> bool:
            stream = aio.WatchEvents(fm.WatchEventsRequest(after_revision=0), OPEN_CALL)
            assert (await stream.__anext__()).event.revision == 1
            holder.start()
            assert held.wait(WAIT_S)
            await stream.aclose()  # the client went away
            return not gave_up.is_set()

        holder = threading.Thread(target=change_holding_the_lock)
        try:
            assert asyncio.run(cancel_while_held()), "the loop waited for the composer's lock to close the watch"
        finally:
            release.set()
            holder.join(WAIT_S)

    def test_one_cancelled_as_the_server_stops_leaves_no_error_unread(
        self, on_a_loop: tuple[FabricComposer, AsyncFabricManagerServicer, ThreadPoolExecutor]
    ) -> None:
        """The client went away while a worker waited for the next event, and the server stopped before that
        worker woke: the watch ended there with UNAVAILABLE, which nobody read, and asyncio logged "Future
        exception was never retrieved" with its traceback, an error in the log of a clean stop."""
        _, aio, _ = on_a_loop

        async def cancel_then_stop() -> list[str]:
            told: list[str] = []
            asyncio.get_running_loop().set_exception_handler(lambda _, context: told.append(context["message"]))
            stream = aio.WatchEvents(fm.WatchEventsRequest(after_revision=0), OPEN_CALL)
            assert (await stream.__anext__()).event.revision == 1
            waiting = asyncio.ensure_future(stream.__anext__())  # a worker waits for a live event
            await asyncio.sleep(0.1)
            waiting.cancel()  # the client went away
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            aio.servicer.stop()
            while len(aio.servicer.watches):  # the worker woke, and the watch ended
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # its close, called back on the loop, has run
            del waiting, stream
            gc.collect()
            return told

        assert "Future exception was never retrieved" not in asyncio.run(cancel_then_stop())

    def test_one_cancelled_after_the_workers_stopped_is_closed_still(
        self, on_a_loop: tuple[FabricComposer, AsyncFabricManagerServicer, ThreadPoolExecutor]
    ) -> None:
        """The server stopping: its worker threads gone, the watch is closed where it ends, its listener removed."""
        comp, aio, threads = on_a_loop

        async def cancel_after_the_workers() -> int:
            stream = aio.WatchEvents(fm.WatchEventsRequest(after_revision=0), OPEN_CALL)
            assert (await stream.__anext__()).event.revision == 1
            threads.shutdown(wait=True)
            listening = len(comp._listeners)
            await stream.aclose()
            return listening

        listening = asyncio.run(cancel_after_the_workers())
        assert listening == 1 and comp._listeners == []
