"""The etcd ledger keeps its event log and request ids to their retention however often its leader restarts,
serves the same events as the in-memory ledger at the retention boundary, and refuses a retention that keeps
nothing, as the SQLite ledger does (`test_ledger_retention`). Against one real etcd member on loopback
(`etcd_helpers`), each test under its own key prefix; without etcd they are skipped (failed on CI)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import etcd3gw
import pytest
import requests
from composer_helpers import composer
from disagg.composer import FabricComposer
from disagg.errors import ConfigError, FabricUnavailableError, RevisionCompactedError
from disagg.server.watch import Watches, watch_events
from disagg.store import EtcdStore, MemoryStore
from disagg.store import etcd as etcd_store
from disagg.store.base import RequestRecord
from etcd_helpers import EtcdCluster, free_ports, fresh_prefix, one_etcd_member, raw_client
from retention_helpers import (
    GPU,
    assert_same_log,
    assert_timed_resume_at_the_edge_refused_as_on_memory,
    assert_watch_refused_as_on_memory,
    event,
)
from server_helpers import FakeContext

LIVES = 20
"""Leader lifetimes in a restart test, each shorter than a prune step."""
PER_LIFE = 9


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


@pytest.fixture
def prefix() -> str:
    return fresh_prefix()


def _keys(cluster: EtcdCluster, prefix: str) -> int:
    """Keys under ``prefix`` in etcd, counted by a client of its own."""
    host, port = cluster.endpoints[0].rsplit(":", 1)
    client = etcd3gw.client(host=host, port=int(port), timeout=5.0, api_path="/v3/")
    try:
        return len(client.get_prefix(prefix))
    finally:
        client.session.close()


@contextlib.contextmanager
def _life(cluster: EtcdCluster, prefix: str, **options: int) -> Iterator[EtcdStore]:
    """One leader's lifetime of the ledger: a store of its own, written, closed."""
    store = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True, **options)
    try:
        yield store
    finally:
        store.close()


class TestPruningAcrossRestarts:
    """A leader that restarts (or hands over) before a prune step of its own still prunes: the step is counted
    from what etcd holds, not from what one process wrote."""

    @pytest.mark.parametrize(("retention", "step"), [(10, 1_000), (20, 5)])
    def test_event_log(
        self, cluster: EtcdCluster, prefix: str, monkeypatch: pytest.MonkeyPatch, retention: int, step: int
    ) -> None:
        monkeypatch.setattr(etcd_store, "PRUNE_EVERY", step)
        revision = 0
        for _ in range(LIVES):
            with _life(cluster, prefix, event_retention=retention) as store:
                for _ in range(PER_LIFE):
                    revision += 1
                    store.append_event(event(revision))
        assert _keys(cluster, f"{prefix}events/") <= retention + min(step, retention) - 1
        with _life(cluster, prefix, event_retention=retention) as store:
            kept = [e.revision for e in store.events_after(0, 10 * retention)]
            assert store.load().last_revision == revision
        assert kept == list(range(revision - retention + 1, revision + 1))

    def test_request_ids(self, cluster: EtcdCluster, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
        retention = 10
        monkeypatch.setattr(etcd_store, "REQUEST_RETENTION", retention)
        put = 0
        for _ in range(LIVES):
            with _life(cluster, prefix) as store:
                for _ in range(PER_LIFE):
                    put += 1
                    store.put_request(RequestRecord(f"r{put}", "f", "{}", float(put)))
        assert _keys(cluster, f"{prefix}requests/") < 2 * retention
        with _life(cluster, prefix) as store:
            kept = [r.id for r in store.load().requests]
        assert kept == [f"r{n}" for n in range(put - retention + 1, put + 1)]


class TestRetentionBoundary:
    """What the etcd ledger serves is cut at the retention as the in-memory ledger's is, whatever keys a prune
    has yet to delete: a watch is served or refused alike on both."""

    @pytest.mark.parametrize("retention", [2, 5])
    def test_events_after_as_memory(self, cluster: EtcdCluster, prefix: str, retention: int) -> None:
        memory = MemoryStore(event_retention=retention)
        with _life(cluster, prefix, event_retention=retention) as store:
            for revision in range(1, 4 * retention + 4):
                memory.append_event(event(revision))
                store.append_event(event(revision))
                assert_same_log(memory, store, revision)

    def test_after_a_restart(self, cluster: EtcdCluster, prefix: str) -> None:
        """A leader that starts on a log holding more than its retention (a prune step not yet due) serves
        just the retention's events, as it would have before the restart."""
        with _life(cluster, prefix, event_retention=5) as store:
            for revision in range(1, 10):
                store.append_event(event(revision))
        with _life(cluster, prefix, event_retention=5) as store:
            assert [e.revision for e in store.events_after(0)] == [5, 6, 7, 8, 9]
            assert [e.revision for e in store.events_after(6)] == [7, 8, 9]

    def test_watch_refused_as_on_memory(self, cluster: EtcdCluster, prefix: str) -> None:
        assert_watch_refused_as_on_memory(EtcdStore(cluster.endpoints, prefix=prefix, event_retention=5, unfenced=True))

    def test_timed_resume_at_the_edge_refused_as_on_memory(self, cluster: EtcdCluster, prefix: str) -> None:
        assert_timed_resume_at_the_edge_refused_as_on_memory(
            EtcdStore(cluster.endpoints, prefix=prefix, event_retention=5, unfenced=True)
        )


class TestRetentionAtLeastOne:
    """A retention that keeps no event is a configuration error when the ledger is made, as on every ledger."""

    @pytest.mark.parametrize("retention", [0, -1])
    def test_refused(self, retention: int) -> None:
        with pytest.raises(ConfigError, match="event_retention must be at least 1"):
            EtcdStore(["127.0.0.1:1"], event_retention=retention)


class TestFirstReadOfAWrite:
    """The first append and the first put of a request id read etcd before they write (where the log starts,
    how many ids it holds): that read failing fails the store as a failed write does, since the composer has
    changed its memory already."""

    @pytest.mark.parametrize("write", ["append_event", "put_request"])
    def test_fails_the_store(self, write: str) -> None:
        store = EtcdStore([f"127.0.0.1:{free_ports(1)[0]}"], timeout_s=0.5, unfenced=True)
        calls: dict[str, Callable[[], None]] = {
            "append_event": lambda: store.append_event(event(1)),
            "put_request": lambda: store.put_request(RequestRecord("r1", "f", "{}", 1.0)),
        }
        try:
            with pytest.raises(FabricUnavailableError, match="no etcd endpoint answered"):
                calls[write]()
            assert "no etcd endpoint answered" in store.failure
        finally:
            store.close()


def _changes(comp: FabricComposer, count: int) -> None:
    """``count`` events, one per change."""
    for n in range(count):
        (comp.cordon if n % 2 == 0 else comp.uncordon)(GPU)


def _compact_after_the_first_page(
    store: EtcdStore, cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], None]
) -> list[int]:
    """Once ``store`` has read a first page, call ``meanwhile``, then have etcd compact its latest revision, as an
    operator's ``etcdctl compact`` (or etcd's auto-compaction) does; the revision compacted, once it is."""
    endpoint = cluster.endpoints[0]
    read = store._range
    compacted: list[int] = []

    def compact_after_a_page(start: bytes, end: bytes, **kw: Any) -> Any:
        answer = read(start, end, **kw)
        if kw.get("limit", 0) > 1 and not compacted:
            compacted.append(0)
            meanwhile()
            client = raw_client(endpoint)
            try:
                client.put("/elsewhere", "x")  # another program writes
                ((_, meta),) = client.get("/elsewhere", metadata=True)
            finally:
                client.session.close()
            compacted[0] = int(meta["mod_revision"])
            url = f"http://{endpoint}/v3/kv/compaction"
            requests.post(url, json={"revision": compacted[0], "physical": True}, timeout=5).raise_for_status()
        return answer

    monkeypatch.setattr(store, "_range", compact_after_a_page)
    return compacted


class TestCompactionBetweenPages:
    """A watch catching up over several pages of the log outlives a compaction of etcd between two of them,
    with no event missed or sent twice; events pruned meanwhile end it as the retention says (OUT_OF_RANGE)."""

    def test_a_watch_catches_up(self, cluster: EtcdCluster, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(etcd_store, "PAGE", 2)
        store = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True)
        comp = composer(store=store)
        context = FakeContext()
        try:
            _changes(comp, 7)
            comp.store.sync()
            compacted = _compact_after_the_first_page(store, cluster, monkeypatch, lambda: None)
            watch = watch_events(comp, 0, context, Watches(4))  # type: ignore[arg-type]
            sent = [next(watch).revision for _ in range(comp.revision)]
            assert compacted[0] and sent == list(range(1, comp.revision + 1))
        finally:
            context.cancel()
            comp.close()

    def test_events_pruned_meanwhile_end_the_watch(
        self, cluster: EtcdCluster, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The watch after 1 read 2 and 3; 6 changes later the log holds 8 to 12 only: 4 to 7 are gone."""
        monkeypatch.setattr(etcd_store, "PAGE", 2)
        monkeypatch.setattr(etcd_store, "PRUNE_EVERY", 1)
        store = EtcdStore(cluster.endpoints, prefix=prefix, unfenced=True, event_retention=5)
        comp = composer(store=store)
        context = FakeContext()
        try:
            _changes(comp, 6)
            comp.store.sync()
            compacted = _compact_after_the_first_page(store, cluster, monkeypatch, lambda: _changes(comp, 6))
            with pytest.raises(RevisionCompactedError, match="events 2 to 7 are no longer retained; the oldest is 8"):
                next(watch_events(comp, 1, context, Watches(4)))  # type: ignore[arg-type]
            assert compacted[0]
            assert [e.revision for e in store.events_after(1)] == [8, 9, 10, 11, 12]
        finally:
            context.cancel()
            comp.close()
